// A small Markdown renderer for model answers: fenced code blocks, lists (nested by indentation), headings,
// paragraphs, inline code, bold and italic. The whole source is HTML-escaped first, so nothing the model writes
// can become markup other than the tags produced here. It is re-run on the growing text while a reply streams,
// so an unclosed code fence renders as a code block so far.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (ch) => ESCAPES[ch]);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;

export function renderMarkdown(source) {
  const lines = escapeHtml(source.replace(/\r\n?/g, "\n")).split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      i = codeBlock(lines, i, fence, out);
    } else if (!line.trim()) {
      i += 1;
    } else if (HEADING.test(line)) {
      const [, hashes, text] = HEADING.exec(line);
      const level = Math.min(hashes.length + 3, 6); // the page's own headings end at h3
      out.push(`<h${level}>${inline(text)}</h${level}>`);
      i += 1;
    } else if (LIST_ITEM.test(line)) {
      const end = listEnd(lines, i);
      out.push(renderList(lines.slice(i, end)));
      i = end;
    } else {
      const start = i;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])) i += 1;
      out.push(`<p>${lines.slice(start, i).map((l) => inline(l.trim())).join("<br>")}</p>`);
    }
  }
  return out.join("\n");
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || LIST_ITEM.test(line);
}

function codeBlock(lines, i, fence, out) {
  const marker = fence[1];
  const body = [];
  let j = i + 1;
  while (j < lines.length && !lines[j].trim().startsWith(marker)) body.push(lines[j++]);
  const lang = fence[2] ? ` class="language-${fence[2]}"` : "";
  out.push(`<pre><code${lang}>${body.join("\n")}</code></pre>`);
  return j + 1;
}

// A list runs over its items, their indented continuation lines and single blank lines between items.
function listEnd(lines, i) {
  let j = i + 1;
  while (j < lines.length) {
    const line = lines[j];
    if (LIST_ITEM.test(line) || (/^\s+\S/.test(line) && !FENCE.test(line))) {
      j += 1;
    } else if (!line.trim() && j + 1 < lines.length && LIST_ITEM.test(lines[j + 1])) {
      j += 1;
    } else {
      break;
    }
  }
  return j;
}

function indentOf(line) {
  return line.length - line.trimStart().length;
}

function renderList(lines) {
  const first = LIST_ITEM.exec(lines[0]);
  const base = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  for (const line of lines) {
    const item = LIST_ITEM.exec(line);
    if (item && item[1].length <= base) {
      items.push({ text: [item[3]], nested: [] });
    } else if (item || (line.trim() && indentOf(line) > base + 1)) {
      items[items.length - 1].nested.push(line);
    } else if (line.trim()) {
      items[items.length - 1].text.push(line.trim());
    }
  }
  const body = items.map(({ text, nested }) => {
    const sub = nested.some((l) => LIST_ITEM.test(l)) ? renderList(nested.filter((l) => l.trim()))
      : nested.map((l) => inline(l.trim())).join("<br>");
    const lead = text.map(inline).join("<br>");
    return `<li>${lead}${sub && !sub.startsWith("<") ? "<br>" : ""}${sub}</li>`;
  }).join("");
  const start = ordered && parseInt(first[2], 10) !== 1 ? ` start="${parseInt(first[2], 10)}"` : "";
  return ordered ? `<ol${start}>${body}</ol>` : `<ul>${body}</ul>`;
}

// Code spans are cut out first so their contents keep their asterisks and underscores.
function inline(text) {
  return text.split(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/).map((part, k) => {
    if (k % 3 === 2) return `<code>${part.trim() || part}</code>`;
    if (k % 3 === 1) return "";
    return emphasis(part);
  }).join("");
}

function emphasis(text) {
  return text
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/\*(?=[^\s*])([^*]*?[^\s*])\*/g, "<em>$1</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>");
}
