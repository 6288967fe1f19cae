// The playground: a chat client for this server's OpenAI-compatible API, same origin, no dependencies.
import { renderMarkdown } from "/static/markdown.js";

const KEY_STORAGE = "reasoning-engine.api-key"; // sessionStorage: the key lives as long as this tab
// The calculator as the bundled model learned it (reasoning_engine/tiny/data.py, calculator_tool()).
const CALCULATOR_TOOL = [{
  type: "function",
  function: {
    name: "calculator",
    description: "Evaluate an arithmetic expression and return the result.",
    parameters: {
      type: "object",
      properties: { expression: { type: "string", description: "The expression to evaluate, e.g. 12 * 34" } },
      required: ["expression"],
    },
  },
}];

const $ = (id) => document.getElementById(id);
const ui = {
  conversation: $("conversation"), emptyHint: $("empty-hint"), error: $("error"), composer: $("composer"),
  prompt: $("prompt"), send: $("send"), stop: $("stop"), newChat: $("new-chat"),
  settings: $("settings"), settingsToggle: $("settings-toggle"), model: $("model"),
  apiKeyField: $("api-key-field"), apiKey: $("api-key"), systemPrompt: $("system-prompt"),
  temperature: $("temperature"), maxTokens: $("max-tokens"), thinking: $("thinking"),
  thinkingBudget: $("thinking-budget"), speculative: $("speculative"), adaptive: $("adaptive"), tools: $("tools"),
  toolsExample: $("tools-example"), attach: $("attach"), attachFile: $("attach-file"), attachments: $("attachments"),
};

const state = {
  history: [], // the conversation as the API takes it; a turn joins it once its reply is in
  controller: null, // AbortController of the reply in flight
  epoch: 0, // bumped by "New chat", so a reply stopped by it stays out of the new conversation
  speculative: null, // the server's speculative setting, null when off
  fields: 0, // numbers the tool-result fields, for their label ids
  attachments: [], // images for the next message: { name, url } with a data: URL
};

class APIError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// ---- API ------------------------------------------------------------------------------------------------------

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function errorFrom(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = body.error.message;
  } catch {
    // not JSON: the status line says enough
  }
  return new APIError(response.status, message);
}

async function getJSON(path) {
  const response = await fetch(path, { headers: headers() });
  if (!response.ok) throw await errorFrom(response);
  return response.json();
}

// Server-sent events from a fetch body: `data:` payloads parsed as JSON, ending at `[DONE]`.
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// ---- connecting -----------------------------------------------------------------------------------------------

async function connect() {
  try {
    const models = await getJSON("/v1/models");
    const previous = ui.model.value;
    ui.model.replaceChildren(...models.data.map((m) => new Option(m.id, m.id)));
    if (models.data.some((m) => m.id === previous)) ui.model.value = previous;
    const info = await getJSON("/playground/info");
    state.speculative = info.speculative;
    const spec = info.speculative;
    ui.speculative.textContent = !spec ? "Off" : spec.num_speculative_tokens
      ? `On: ${spec.method}, up to ${spec.num_speculative_tokens} draft tokens per step` : `On: ${spec.method}`;
    ui.attach.hidden = !info.vision; // only a model with a vision tower takes images
    if (!info.vision) setAttachments([]);
    await showAdaptive();
    hideError();
  } catch (error) {
    if (error.status === 401) {
      askForKey();
    } else {
      showError(describe(error));
    }
  }
}

function askForKey() {
  ui.apiKeyField.hidden = false;
  openSettings(true);
  showError(sessionStorage.getItem(KEY_STORAGE)
    ? "The server refused the API key. Check it in Settings."
    : "This server requires an API key. Enter it in Settings.");
  ui.apiKey.focus();
}

function describe(error) {
  if (error instanceof APIError && error.status) return `Error ${error.status}: ${error.message}`;
  if (error instanceof TypeError) return `Could not reach the server: ${error.message}`; // fetch's network failure
  return `Error: ${error.message}`;
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = false;
}

function hideError() {
  ui.error.hidden = true;
  ui.error.textContent = "";
}

// ---- the request ----------------------------------------------------------------------------------------------

function numberField(input, name) {
  if (input.value.trim() === "") return undefined;
  if (!input.checkValidity()) throw new Error(`${name}: ${input.validationMessage}`);
  return Number(input.value);
}

function requestBody(messages) {
  const body = {
    model: ui.model.value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: numberField(ui.temperature, "Temperature"),
    max_tokens: numberField(ui.maxTokens, "Max tokens"),
    chat_template_kwargs: { thinking: ui.thinking.checked },
  };
  if (ui.thinking.checked) body.thinking_token_budget = numberField(ui.thinkingBudget, "Thinking budget");
  if (ui.tools.value.trim()) {
    try {
      body.tools = JSON.parse(ui.tools.value);
    } catch (error) {
      throw new Error(`Tools: not valid JSON (${error.message})`);
    }
  }
  return body;
}

function conversationFor(pending) {
  const system = ui.systemPrompt.value.trim();
  return [...(system ? [{ role: "system", content: system }] : []), ...state.history, ...pending];
}

// ---- a reply --------------------------------------------------------------------------------------------------

class Reply {
  constructor() {
    this.el = document.getElementById("assistant-turn").content.firstElementChild.cloneNode(true);
    this.q = (selector) => this.el.querySelector(selector);
    this.reasoning = "";
    this.content = "";
    this.toolCalls = [];
    this.usage = null;
    this.finish = null;
    this.counts = { reasoning: 0, answer: 0 }; // streamed chunks, until the usage gives exact token counts
    this.sent = performance.now();
    this.firstToken = null;
    this.firstAnswer = null;
    this.last = null;
    this.ended = false;
    this.frame = 0;
  }

  apply(delta, finishReason) {
    const now = performance.now();
    if (delta.reasoning_content) {
      this.reasoning += delta.reasoning_content;
      this.counts.reasoning += 1;
      this.firstToken ??= now;
      this.last = now;
    }
    if (delta.content || delta.tool_calls) {
      this.content += delta.content || "";
      for (const call of delta.tool_calls || []) this.mergeToolCall(call);
      this.counts.answer += 1;
      this.firstToken ??= now;
      this.firstAnswer ??= now;
      this.last = now;
    }
    if (finishReason) this.finish = finishReason;
    this.scheduleRender();
  }

  mergeToolCall(part) {
    const call = this.toolCalls[part.index] ??= { id: "", type: "function", function: { name: "", arguments: "" } };
    if (part.id) call.id = part.id;
    if (part.function && part.function.name) call.function.name = part.function.name;
    if (part.function && part.function.arguments) call.function.arguments += part.function.arguments;
  }

  // One repaint per frame however fast the deltas come.
  scheduleRender() {
    if (!this.frame) {
      this.frame = requestAnimationFrame(() => {
        this.frame = 0;
        this.render();
      });
    }
  }

  render() {
    const thinking = this.q(".thinking");
    if (this.reasoning) {
      thinking.hidden = false;
      this.q(".thinking-text").textContent = this.reasoning;
    }
    if (this.firstAnswer !== null && thinking.dataset.collapsed !== "yes") {
      thinking.open = false; // the answer has started: fold the thinking away, once
      thinking.dataset.collapsed = "yes";
    }
    const thoughtUntil = this.firstAnswer ?? (this.ended ? this.last : null);
    if (thoughtUntil !== null && this.reasoning) {
      this.q(".thinking-title").textContent = `Thought for ${seconds(thoughtUntil - this.sent)}`;
    }
    this.q(".answer").innerHTML = renderMarkdown(this.content);
    this.renderToolCalls();
    this.renderFigures();
    followBottom();
  }

  renderToolCalls() {
    const box = this.q(".tool-calls");
    this.toolCalls.forEach((call, index) => {
      let card = box.children[index];
      if (!card) {
        card = document.getElementById("tool-call-card").content.firstElementChild.cloneNode(true);
        box.append(card);
      }
      card.querySelector(".tool-name").textContent = call.function.name;
      card.querySelector(".tool-id").textContent = call.id;
      card.querySelector(".tool-args code").textContent = prettyJSON(call.function.arguments);
    });
  }

  renderFigures() {
    const exact = this.usage && this.usage.completion_tokens_details;
    const reasoning = exact ? this.usage.completion_tokens_details.reasoning_tokens : this.counts.reasoning;
    const answer = exact ? this.usage.completion_tokens - reasoning : this.counts.answer;
    this.q(".fig-ttft").textContent = this.firstToken === null ? "–" : seconds(this.firstToken - this.sent);
    this.q(".fig-ttfat").textContent = this.firstAnswer === null ? "–" : seconds(this.firstAnswer - this.sent);
    // Decode speed: the tokens after the first over the time since the first arrived.
    const span = this.last !== null ? (this.last - this.firstToken) / 1000 : 0;
    const total = reasoning + answer;
    this.q(".fig-tps").textContent = span > 0 && total > 1 ? `${((total - 1) / span).toFixed(1)} tok/s` : "– tok/s";
    this.q(".fig-reasoning").textContent = String(reasoning);
    this.q(".fig-answer").textContent = String(answer);
  }

  showSpeculative(accepted, drafted) {
    this.q(".fig-spec-item").hidden = false;
    this.q(".fig-spec").textContent = drafted > 0
      ? `${Math.round((100 * accepted) / drafted)}% (${accepted} of ${drafted} drafted)` : "no drafts";
  }

  setStatus(text, kind) {
    const status = this.q(".reply-status");
    status.textContent = text;
    status.className = `reply-status ${kind}`;
    status.hidden = false;
  }

  message() {
    const message = { role: "assistant", content: this.content };
    if (this.reasoning) message.reasoning_content = this.reasoning;
    if (this.toolCalls.length) message.tool_calls = this.toolCalls;
    return message;
  }
}

function seconds(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

function prettyJSON(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text; // still streaming, or not JSON: show it as it is
  }
}

// The adaptive engine's state in one line: what it has learned and what it last decided.
async function showAdaptive() {
  const a = await getJSON("/v1/engine/adaptive");
  if (!a.enabled) {
    ui.adaptive.textContent = "Off";
    return;
  }
  if (!a.cost_model) {
    ui.adaptive.textContent = "On (no step measured yet)";
    return;
  }
  const parts = [`cost model ${a.cost_model.ready ? "ready" : "learning"} (${a.cost_model.observations} steps${a.warm_start ? ", warm start" : ""})`];
  if (a.speculation.method) {
    const d = a.speculation.last_draft_lengths;
    parts.push(`last drafts ${d.mean.toFixed(1)} tokens on average (max ${d.max})`);
    const off = Object.entries(a.speculation.gate || {}).filter(([, g]) => !g.drafting).map(([sizes]) => sizes);
    const chunk = " beside a chunk";
    const alone = off.filter((sizes) => !sizes.endsWith(chunk));
    const beside = off.filter((sizes) => sizes.endsWith(chunk)).map((sizes) => sizes.slice(0, -chunk.length));
    if (alone.length) parts.push(`drafting off at ${alone.join(", ")} decoding requests`);
    if (beside.length) parts.push(`off beside a prefill chunk at ${beside.join(", ")}`);
  }
  if (a.batching.last_token_budget !== null) parts.push(`token budget ${a.batching.last_token_budget}`);
  parts.push(`${a.retention.turns_protected} turns kept, ${a.retention.retention_hit_tokens} tokens reused`);
  ui.adaptive.textContent = `On: ${parts.join("; ")}`;
}

async function specCounters() {
  const info = await getJSON("/playground/info");
  return { accepted: info.accepted_tokens, drafted: info.draft_tokens };
}

// ---- images ---------------------------------------------------------------------------------------------------

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attachFiles(files) {
  const added = [];
  for (const file of files) {
    if (!file.type.startsWith("image/")) {
      showError(`${file.name} is not an image.`);
      continue;
    }
    added.push({ name: file.name, url: await readAsDataURL(file) });
  }
  setAttachments([...state.attachments, ...added]);
}

function thumbnail(image) {
  const img = document.createElement("img");
  img.className = "thumb";
  img.src = image.url;
  img.alt = image.name;
  return img;
}

// The images waiting for the next message, each with a button that takes it out again.
function setAttachments(images) {
  state.attachments = images;
  ui.attachments.replaceChildren(...images.map((image, index) => {
    const item = document.createElement("li");
    item.className = "attachment";
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "secondary";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove ${image.name}`);
    remove.addEventListener("click", () => {
      setAttachments(state.attachments.filter((_, i) => i !== index));
      ui.prompt.focus();
    });
    item.append(thumbnail(image), remove);
    return item;
  }));
  ui.attachments.hidden = images.length === 0;
}

// ---- sending --------------------------------------------------------------------------------------------------

// `pending`: the messages this turn adds (a user message, or tool results); they join the history with the reply,
// so a failed request leaves the history as it was. `onFail` undoes the turn's own display. Resolves to whether
// the turn joined the conversation.
async function run(pending, onFail) {
  let body;
  try {
    body = requestBody(conversationFor(pending));
  } catch (error) {
    showError(error.message);
    onFail();
    return false;
  }
  hideError();
  const epoch = state.epoch;
  const controller = new AbortController();
  setBusy(controller);
  const specBefore = state.speculative ? await specCounters().catch(() => null) : null;
  const reply = new Reply(); // after the counters, so the timings start with the request
  ui.conversation.append(reply.el);
  let outcome = "done";
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw await errorFrom(response);
    for await (const event of sseEvents(response.body)) {
      if (event.error) throw new APIError(null, event.error.message);
      if (event.usage) reply.usage = event.usage;
      for (const choice of event.choices || []) reply.apply(choice.delta || {}, choice.finish_reason);
    }
  } catch (error) {
    outcome = error.name === "AbortError" ? "stopped" : error;
  }
  try {
    return epoch === state.epoch && await settle(reply, outcome, pending, onFail, specBefore);
  } finally {
    setBusy(null); // last, so assistive technology reads the finished reply once
  }
}

async function settle(reply, outcome, pending, onFail, specBefore) {
  reply.ended = true;
  if (outcome instanceof Error || (outcome === "stopped" && reply.firstToken === null)) {
    reply.el.remove();
    onFail();
    if (outcome.status === 401) askForKey();
    else if (outcome instanceof Error) showError(describe(outcome));
    return false;
  }
  state.history.push(...pending, reply.message());
  // The last deltas may still wait for their animation frame: draw them now, so the tool-call cards exist before
  // offerToolResults adds its fields and the "Send result" button after them.
  reply.render();
  if (outcome === "stopped") {
    reply.setStatus("Stopped.", "stopped");
  } else if (reply.finish === "length") {
    reply.setStatus("Reached the max-tokens limit.", "warning");
  } else if (reply.toolCalls.length) {
    offerToolResults(reply);
  }
  if (specBefore) {
    const after = await specCounters().catch(() => null);
    if (after) reply.showSpeculative(after.accepted - specBefore.accepted, after.drafted - specBefore.drafted);
  }
  await showAdaptive().catch(() => {}); // a figure, not the reply: a failure here changes nothing
  return true;
}

function setBusy(controller) {
  state.controller = controller;
  const busy = controller !== null;
  ui.conversation.setAttribute("aria-busy", String(busy));
  // Focus stays in the message box; it follows only a button that is about to disappear.
  const focusStop = busy && document.activeElement === ui.send;
  const focusPrompt = !busy && document.activeElement === ui.stop;
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  if (focusStop) ui.stop.focus();
  if (focusPrompt) ui.prompt.focus();
}

function stop() {
  if (state.controller) state.controller.abort();
}

function sendMessage() {
  const text = ui.prompt.value;
  const images = state.attachments;
  if ((!text.trim() && !images.length) || state.controller) return;
  ui.emptyHint.hidden = true;
  const turn = document.getElementById("user-turn").content.firstElementChild.cloneNode(true);
  const bubble = turn.querySelector(".bubble");
  bubble.textContent = text;
  if (images.length) {
    const thumbs = document.createElement("div");
    thumbs.className = "thumbs";
    thumbs.append(...images.map(thumbnail));
    bubble.prepend(thumbs);
  }
  ui.conversation.append(turn);
  ui.prompt.value = "";
  setAttachments([]);
  followBottom(true);
  // With images the content is a list of parts: the images as data: URLs, then the text.
  const content = !images.length ? text : [
    ...images.map((image) => ({ type: "image_url", image_url: { url: image.url } })),
    ...(text.trim() ? [{ type: "text", text }] : []),
  ];
  run([{ role: "user", content }], () => {
    turn.remove();
    if (!ui.prompt.value) ui.prompt.value = text; // give the text and images back for another try
    if (!state.attachments.length) setAttachments(images);
    ui.emptyHint.hidden = state.history.length > 0;
  });
}

// The model asked for tools: one field per call, sent back as `tool` messages.
function offerToolResults(reply) {
  const cards = [...reply.q(".tool-calls").children];
  reply.setStatus("The model called a tool. Enter each result and send it back.", "info");
  cards.forEach((card, index) => {
    const field = card.querySelector(".tool-result");
    const id = `tool-result-${(state.fields += 1)}`;
    field.querySelector("label").htmlFor = id;
    field.querySelector("textarea").id = id;
    field.hidden = false;
    if (index === 0) field.querySelector("textarea").focus();
  });
  const button = document.createElement("button");
  button.type = "button";
  button.textContent = cards.length > 1 ? "Send results" : "Send result";
  reply.q(".tool-calls").append(button);
  button.addEventListener("click", async () => {
    if (state.controller) return;
    const results = reply.toolCalls.map((call, index) => ({
      role: "tool", tool_call_id: call.id, content: cards[index].querySelector("textarea").value,
    }));
    button.disabled = true;
    cards.forEach((card) => { card.querySelector("textarea").readOnly = true; });
    const sent = await run(results, () => {
      button.disabled = false;
      cards.forEach((card) => { card.querySelector("textarea").readOnly = false; });
    });
    if (sent) {
      button.remove();
      reply.setStatus(cards.length > 1 ? "Results sent back." : "Result sent back.", "info");
      if (document.activeElement === document.body) ui.prompt.focus(); // the focused button is gone
    }
  });
}

// Keep the newest text in view unless the reader has scrolled up to read something earlier.
function followBottom(force = false) {
  const box = ui.conversation;
  if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
}

function newChat() {
  stop();
  state.epoch += 1;
  state.history = [];
  setAttachments([]);
  ui.conversation.querySelectorAll(".turn").forEach((turn) => turn.remove());
  ui.emptyHint.hidden = false;
  hideError();
  ui.prompt.focus();
}

function openSettings(open) {
  ui.settings.hidden = !open;
  ui.settingsToggle.setAttribute("aria-expanded", String(open));
}

// ---- wiring ---------------------------------------------------------------------------------------------------

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  sendMessage();
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    sendMessage();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && state.controller) {
    event.preventDefault();
    stop();
  }
});
ui.stop.addEventListener("click", stop);
ui.newChat.addEventListener("click", newChat);
ui.settingsToggle.addEventListener("click", () => openSettings(ui.settings.hidden));
ui.thinking.addEventListener("change", () => { ui.thinkingBudget.disabled = !ui.thinking.checked; });
ui.attach.addEventListener("click", () => ui.attachFile.click());
ui.attachFile.addEventListener("change", async () => {
  const files = [...ui.attachFile.files];
  ui.attachFile.value = ""; // choosing the same file again fires `change` again
  await attachFiles(files).catch((error) => showError(`Could not read the image: ${error.message}`));
  ui.prompt.focus();
});
ui.toolsExample.addEventListener("click", () => {
  ui.tools.value = JSON.stringify(CALCULATOR_TOOL, null, 2);
  ui.tools.focus();
});
// Enter fires both `change` and the form's submit: only a new key reconnects.
function saveKey() {
  const key = ui.apiKey.value.trim();
  if (key === (sessionStorage.getItem(KEY_STORAGE) || "")) return;
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
  connect();
}
ui.apiKey.addEventListener("change", saveKey);
ui.apiKeyField.addEventListener("submit", (event) => {
  event.preventDefault();
  saveKey();
});

if (sessionStorage.getItem(KEY_STORAGE)) {
  ui.apiKeyField.hidden = false;
  ui.apiKey.value = sessionStorage.getItem(KEY_STORAGE);
}
openSettings(window.matchMedia("(min-width: 56rem)").matches);
ui.prompt.focus();
connect();
