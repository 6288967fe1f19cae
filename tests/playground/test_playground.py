"""The playground page in real headless Chromium against a real `reasoning-engine serve`.

Answers are checked only with the bundled tiny model (greedy); the mechanics (streaming, figures, stop, errors,
API key, speculative decoding, narrow screens, contrast, Markdown) run with any model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import httpx
import pytest
from playwright.sync_api import Page, Route, expect

from server.helpers import metric_value, wait_for

from .helpers import ARTIFACTS, ROOT, Served

pytestmark = pytest.mark.slow  # a browser against a live server

ABORTS = "reasoning_engine:request_success_total"
RUNNING = "reasoning_engine:num_requests_running"
KV_USAGE = "reasoning_engine:kv_cache_usage_perc"
# The recorder notes the newest reply's thinking section at every DOM change, to see it open while the model
# thinks and folded once the answer starts.
RECORD_THINKING = """() => {
  window.thinkingStates = [];
  new MutationObserver(() => {
    const turn = [...document.querySelectorAll('.turn.assistant')].pop();
    if (!turn) return;
    const details = turn.querySelector('.thinking');
    window.thinkingStates.push({visible: !details.hidden, open: details.open,
      thinking: turn.querySelector('.thinking-text').textContent.length,
      answer: turn.querySelector('.answer').textContent.trim().length});
  }).observe(document.getElementById('conversation'),
             {subtree: true, childList: true, characterData: true, attributes: true});
}"""


@pytest.fixture(scope="module")
def served(serve: Callable[..., Served]) -> Served:
    return serve()


def open_playground(page: Page, served: Served, *, temperature: str = "0", max_tokens: str = "") -> None:
    page.goto(f"{served.url}/")
    page.wait_for_function("() => document.getElementById('model').options.length > 0")
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)


def ask(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


RECORD_STOP_SHOWN = """() => {
  window.stopShown = false;
  const stop = document.getElementById('stop');
  new MutationObserver(() => { if (!stop.hidden) window.stopShown = true; })
    .observe(stop, {attributes: true, attributeFilter: ['hidden']});
}"""


def wait_for_replies(page: Page, count: int) -> None:
    """Until `count` replies are on the page and none is streaming."""
    page.wait_for_function(
        "n => document.querySelectorAll('.turn.assistant').length >= n"
        " && document.getElementById('conversation').getAttribute('aria-busy') === 'false'", arg=count)


def figure(page: Page, name: str, reply: int = -1) -> str:
    return page.locator(f".turn.assistant .fig-{name}").nth(reply).inner_text()


def test_reply_streams_thinking_and_live_figures(page: Page, served: Served) -> None:
    open_playground(page, served, max_tokens="40")
    page.fill("#prompt", "What is 347")
    page.press("#prompt", "Shift+Enter")
    page.type("#prompt", "+ 589?")
    assert page.input_value("#prompt") == "What is 347\n+ 589?"
    expect(page.locator(".turn.user")).to_have_count(0)  # Shift+Enter only added a line
    page.evaluate(RECORD_STOP_SHOWN)  # a short reply may end before a poll of #stop would see it
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    body = json.loads(sent.value.post_data)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["chat_template_kwargs"] == {"thinking": True}
    assert body["max_tokens"] == 40 and body["temperature"] == 0
    assert body["messages"] == [{"role": "user", "content": "What is 347\n+ 589?"}]
    wait_for_replies(page, 1)
    assert page.evaluate("window.stopShown") is True

    expect(page.locator(".turn.user .bubble")).to_have_text("What is 347\n+ 589?")
    expect(page.locator(".turn.assistant .thinking")).to_be_visible()
    assert (page.locator(".turn.assistant .thinking-text").text_content() or "").strip()
    assert re.fullmatch(r"\d+(\.\d+)? tok/s", figure(page, "tps"))
    assert re.fullmatch(r"\d+ ms|\d+\.\d\d s", figure(page, "ttft"))
    reasoning, answer = int(figure(page, "reasoning")), int(figure(page, "answer"))
    assert 0 < reasoning and reasoning + answer <= 40  # exact counts from the usage chunk
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()


def test_answers_after_thinking_and_keeps_the_conversation(page: Page, served: Served) -> None:
    open_playground(page, served)
    page.evaluate(RECORD_THINKING)
    ask(page, "What is 347 + 589?")
    wait_for_replies(page, 1)
    expect(page.locator(".turn.assistant .answer")).to_contain_text("936")
    states = page.evaluate("window.thinkingStates")
    assert any(s["visible"] and s["open"] and s["thinking"] and not s["answer"] for s in states), states
    assert not page.locator(".turn.assistant .thinking").evaluate("d => d.open")  # folded once the answer came
    assert (page.locator(".turn.assistant .thinking-text").text_content() or "").strip()
    assert re.fullmatch(r"\d+(\.\d+)? tok/s", figure(page, "tps"))
    assert re.fullmatch(r"\d+ ms|\d+\.\d\d s", figure(page, "ttfat"))
    assert int(figure(page, "reasoning")) > 0 and int(figure(page, "answer")) > 0

    with page.expect_request("**/v1/chat/completions") as sent:
        ask(page, "What is 903 - 458?")
    wait_for_replies(page, 2)
    expect(page.locator(".turn.assistant .answer").nth(1)).not_to_be_empty()
    earlier = json.loads(sent.value.post_data)["messages"]
    assert [m["role"] for m in earlier] == ["user", "assistant", "user"]
    assert earlier[1]["content"].strip() and earlier[1]["reasoning_content"].strip()  # thinking passed back

    page.locator(".turn.assistant .thinking summary").nth(1).click()  # show the thinking in the picture
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ROOT / "artifacts" / "playground.png"))


# Streamed deltas are painted once per animation frame. On a busy machine the stream can end before the next frame,
# which once left the "Send result" button where the first card belonged and the card never drawn; "late" holds
# every frame back for 3 s to make that the rule.
LATE_FRAMES = "window.requestAnimationFrame = (paint) => setTimeout(paint, 3000);"


@pytest.mark.parametrize("frames", ["prompt", "late"])
def test_tool_call_card_and_result_sent_back(page: Page, served: Served, frames: str) -> None:
    if frames == "late":
        page.add_init_script(LATE_FRAMES)
    open_playground(page, served)
    page.click("#tools-example")
    ask(page, "What is 4821 * 377?")
    wait_for_replies(page, 1)
    card = page.locator(".tool-call")
    expect(card).to_have_count(1)
    expect(card.locator(".tool-name")).to_have_text("calculator")
    assert json.loads(card.locator(".tool-args").inner_text()) == {"expression": "4821 * 377"}
    card.get_by_label("Result").fill("1817517")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.get_by_role("button", name="Send result").click()
    wait_for_replies(page, 2)
    expect(page.locator(".turn.assistant .reply-status").first).to_have_text("Result sent back.")
    messages = json.loads(sent.value.post_data)["messages"]
    assert messages[-1]["role"] == "tool" and messages[-1]["content"] == "1817517"
    assert messages[-1]["tool_call_id"] == messages[-2]["tool_calls"][0]["id"]
    expect(page.locator(".turn.assistant .answer").nth(1)).to_contain_text("1817517")


def _force_long_generation(route: Route) -> None:
    """The model would soon end its reply; ignoring its end-of-sequence token keeps it generating up to
    max_tokens, so there is something to stop."""
    body = json.loads(route.request.post_data or "{}")
    route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))


@pytest.mark.parametrize("how", ["button", "escape"])
def test_stop_aborts_the_generation_and_frees_the_server(page: Page, served: Served, how: str) -> None:
    context = httpx.get(f"{served.url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    max_tokens = context - 128
    open_playground(page, served, max_tokens=str(max_tokens))
    page.route("**/v1/chat/completions", _force_long_generation)
    aborted_before = metric_value(served.metrics(), ABORTS, finished_reason="abort") or 0.0
    ask(page, "What is 347 + 589?")
    page.wait_for_function("() => Number(document.querySelector('.turn.assistant .fig-reasoning').textContent)"
                           " + Number(document.querySelector('.turn.assistant .fig-answer').textContent) >= 5")
    assert metric_value(served.metrics(), RUNNING) == 1  # mid-way: the request is still generating
    if how == "button":
        page.click("#stop")
    else:
        page.keyboard.press("Escape")

    expect(page.locator(".turn.assistant .reply-status")).to_have_text("Stopped.")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#prompt")).to_be_focused()
    assert int(figure(page, "reasoning")) + int(figure(page, "answer")) < max_tokens
    assert wait_for(lambda: metric_value(served.metrics(), ABORTS, finished_reason="abort") == aborted_before + 1,
                    timeout=30), "the server did not abort the request"
    metrics = served.metrics()
    assert metric_value(metrics, RUNNING) == 0 and metric_value(metrics, KV_USAGE) == 0  # its blocks are free


def test_speculative_decoding_state_and_acceptance(page: Page, serve: Callable[..., Served]) -> None:
    speculative = serve("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}')
    open_playground(page, speculative, max_tokens="200")
    expect(page.locator("#speculative")).to_have_text("On: ngram, up to 4 draft tokens per step")
    page.route("**/v1/chat/completions", _force_long_generation)
    ask(page, "What is 347 + 589?")
    wait_for_replies(page, 1)
    expect(page.locator(".turn.assistant .fig-spec")).to_have_text(re.compile(r"\d+% \(\d+ of \d+ drafted\)"))


def test_adaptive_state_is_shown_read_only(page: Page, served: Served) -> None:
    open_playground(page, served)
    adaptive = page.locator("#adaptive")
    expect(adaptive).to_have_text(re.compile(r"^On"))
    ask(page, "What is 347 + 589?")
    wait_for_replies(page, 1)
    expect(adaptive).to_have_text(re.compile(r"On: cost model (ready|learning) \(\d+ steps.*tokens reused"))
    assert adaptive.evaluate("el => el.tagName") == "OUTPUT"  # shown, not editable


def test_api_errors_are_shown_plainly(page: Page, served: Served) -> None:
    open_playground(page, served, max_tokens="1000000")
    ask(page, "What is 347 + 589?")
    error = page.locator("#error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("Error 400")
    expect(error).to_contain_text("maximum context length")
    expect(page.locator(".turn")).to_have_count(0)  # nothing was sent: the turn is withdrawn...
    assert page.input_value("#prompt") == "What is 347 + 589?"  # ...and its text given back to edit


def test_api_key_is_asked_for_and_kept_in_session_storage(page: Page, serve: Callable[..., Served]) -> None:
    key = "playground-test-key"
    keyed = serve("--api-key", key)
    page.goto(f"{keyed.url}/")
    expect(page.locator("#error")).to_contain_text("requires an API key")
    expect(page.locator("#api-key")).to_be_focused()
    assert key not in page.content()
    page.fill("#api-key", key)
    page.press("#api-key", "Enter")
    expect(page.locator("#error")).to_be_hidden()
    page.wait_for_function("() => document.getElementById('model').options.length > 0")
    page.fill("#max-tokens", "8")
    with page.expect_request("**/v1/chat/completions") as sent:
        ask(page, "What is 2 + 3?")
    wait_for_replies(page, 1)
    assert sent.value.headers["authorization"] == f"Bearer {key}"
    expect(page.locator("#error")).to_be_hidden()
    assert page.evaluate("sessionStorage.length") == 1 and page.evaluate("localStorage.length") == 0

    page.evaluate("sessionStorage.clear()")  # a wrong key: the refusal is explained, the key field offered
    page.fill("#api-key", "wrong")
    page.press("#api-key", "Enter")
    expect(page.locator("#error")).to_contain_text("refused the API key")


def test_narrow_screen(page: Page, served: Served) -> None:
    page.set_viewport_size({"width": 360, "height": 740})
    page.goto(f"{served.url}/")
    expect(page.locator("#settings")).to_be_hidden()
    toggle = page.locator("#settings-toggle")
    expect(toggle).to_have_attribute("aria-expanded", "false")
    toggle.click()
    expect(page.locator("#settings")).to_be_visible()
    expect(toggle).to_have_attribute("aria-expanded", "true")
    toggle.click()
    for selector in ("#prompt", "#send"):
        expect(page.locator(selector)).to_be_in_viewport()
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def test_page_is_labelled_for_assistive_technology(page: Page, served: Served) -> None:
    page.goto(f"{served.url}/")
    log = page.locator("#conversation")
    expect(log).to_have_attribute("role", "log")
    expect(log).to_have_attribute("aria-live", "polite")
    if page.locator("#settings").is_hidden():
        page.click("#settings-toggle")
    unlabelled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea')]
        .filter(el => !el.closest('[hidden]') && !(el.labels && el.labels.length))
        .map(el => el.id)""")
    assert unlabelled == []


# WCAG contrast of each element's text colour on the first opaque background behind it.
CONTRASTS = """selectors => {
  const rgb = c => c.match(/[\\d.]+/g).map(Number);
  const lum = ([r, g, b]) => [r, g, b].map(v => v / 255)
    .map(v => v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4)
    .reduce((sum, v, i) => sum + v * [0.2126, 0.7152, 0.0722][i], 0);
  const background = el => {
    for (; el; el = el.parentElement) {
      const c = rgb(getComputedStyle(el).backgroundColor);
      if (c.length === 3 || c[3] === 1) return c;
    }
    return [255, 255, 255];
  };
  return selectors.flatMap(sel => [...document.querySelectorAll(sel)].map(el => {
    const [a, b] = [lum(rgb(getComputedStyle(el).color)), lum(background(el))].sort((x, y) => y - x);
    return [sel, Math.round(100 * (a + 0.05) / (b + 0.05)) / 100];
  }));
}"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_text_contrast(page: Page, served: Served, scheme: str) -> None:
    page.emulate_media(color_scheme=scheme)
    open_playground(page, served, max_tokens="10")
    ask(page, "What is 2 + 3?")
    wait_for_replies(page, 1)
    selectors = ["h1", ".subtitle", "label", ".hint", "button", ".turn.user .bubble", ".thinking summary",
                 ".thinking-text", ".figures dt", ".figures dd", ".reply-status", "#prompt"]
    ratios = page.evaluate(CONTRASTS, selectors)
    assert {sel for sel, _ in ratios} == set(selectors)
    assert [r for r in ratios if r[1] < 4.5] == [], ratios


MARKDOWN_CASES = [
    ("Plain *text* with **bold** and `a*b*c`.",
     "<p>Plain <em>text</em> with <strong>bold</strong> and <code>a*b*c</code>.</p>"),
    ("<script>alert(1)</script>", "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>"),
    ("```python\nif a < b:\n    print('x')\n```", "<pre><code class=\"language-python\">if a &lt; b:\n"
                                                 "    print(&#39;x&#39;)</code></pre>"),
    ("- one\n- two\n  - nested\n- three", "<ul><li>one</li><li>two<ul><li>nested</li></ul></li><li>three</li></ul>"),
    ("3. three\n4. four", '<ol start="3"><li>three</li><li>four</li></ol>'),
    ("first line\nsecond line\n\nnext paragraph", "<p>first line<br>second line</p>\n<p>next paragraph</p>"),
    ("## Result\n347 + 589 = 936", "<h5>Result</h5>\n<p>347 + 589 = 936</p>"),
    ("2 * 3 * 4 and snake_case_name", "<p>2 * 3 * 4 and snake_case_name</p>"),
    ("```\nunclosed while streaming", "<pre><code>unclosed while streaming</code></pre>"),
]


def test_markdown_renderer(page: Page, served: Served) -> None:
    page.goto(f"{served.url}/")
    rendered = page.evaluate("""async cases => {
        const { renderMarkdown } = await import('/static/markdown.js');
        return cases.map(source => renderMarkdown(source));
    }""", [source for source, _ in MARKDOWN_CASES])
    assert rendered == [html for _, html in MARKDOWN_CASES]

