"""The playground's image control in headless Chromium: against the tiny Kimi K2.5 checkpoint
(tests/multimodal/kimi_checkpoint.py) an attached image is sent as a data: URL part, shown as a thumbnail and
answered; against a text-only model the control is not offered."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from multimodal.kimi_checkpoint import build_kimi_k25, noise_image
from server.helpers import save_random_checkpoint

from .helpers import ARTIFACTS, BUNDLED, Served

pytestmark = pytest.mark.slow  # a browser against a live server


@pytest.fixture(scope="module")
def kimi_served(serve: Callable[..., Served], tmp_path_factory: pytest.TempPathFactory) -> Served:
    kimi = build_kimi_k25(tmp_path_factory.mktemp("kimi_k25_playground"))
    # no parsers: the random model's tokens are all answer, so the reply is never hidden as thinking
    return serve("--reasoning-parser", "none", "--tool-call-parser", "none", model=str(kimi.path))


def connected(page: Page, served: Served) -> None:
    """Open the page and wait until it has read /playground/info (the speculative line leaves "Unknown")."""
    page.goto(f"{served.url}/")
    expect(page.locator("#speculative")).not_to_have_text("Unknown")


def test_attached_image_is_sent_shown_and_answered(page: Page, kimi_served: Served, tmp_path: Path) -> None:
    image = tmp_path / "noise.png"
    noise_image(40, 28, seed=5).save(image)
    connected(page, kimi_served)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "8")
    expect(page.locator("#attach")).to_be_visible()
    page.set_input_files("#attach-file", str(image))
    expect(page.locator("#attachments .thumb")).to_have_count(1)
    page.click("#attachments button[aria-label='Remove noise.png']")  # taken out, then attached again
    expect(page.locator("#attachments")).to_be_hidden()
    page.set_input_files("#attach-file", str(image))
    page.fill("#prompt", "describe what you see")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    url = f"data:image/png;base64,{base64.b64encode(image.read_bytes()).decode()}"
    assert json.loads(sent.value.post_data)["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "describe what you see"}]}]
    expect(page.locator("#attachments")).to_be_hidden()
    thumb = page.locator(".turn.user .thumbs img.thumb")
    expect(thumb).to_have_attribute("alt", "noise.png")
    assert thumb.evaluate("img => img.complete && img.naturalWidth") == 40  # the page's CSP lets data: images load
    expect(page.locator(".turn.user .bubble")).to_contain_text("describe what you see")
    page.wait_for_function("() => document.querySelectorAll('.turn.assistant').length === 1"
                           " && document.getElementById('conversation').getAttribute('aria-busy') === 'false'")
    expect(page.locator("#error")).to_be_hidden()
    assert int(page.locator(".turn.assistant .fig-answer").inner_text()) > 0
    assert (page.locator(".turn.assistant .answer").text_content() or "").strip()


def test_no_image_control_for_a_text_model(page: Page, serve: Callable[..., Served], tmp_path: Path) -> None:
    # a random text-only checkpoint: the bundled model has a vision tower
    connected(page, serve(model=str(save_random_checkpoint(tmp_path / "text_model"))))
    expect(page.locator("#attach")).to_be_hidden()
    expect(page.locator("#attachments")).to_be_hidden()


@pytest.mark.skipif(BUNDLED is None, reason="needs the bundled model's files")
def test_bundled_model_answers_a_drawn_picture(page: Page, serve: Callable[..., Served], tmp_path: Path) -> None:
    """The offline demo end to end: a fresh picture the vision data draws (never seen in training: the eval seed),
    attached in the page and answered right by the bundled model, its scan of the picture in the thinking."""
    from reasoning_engine.tiny.vision_data import check_image_answer, eval_image_samples

    sample = eval_image_samples(per_task=1)[0]  # "What colour is the circle?"
    image = tmp_path / "shapes.png"
    sample.meta["image"].save(image)
    connected(page, serve())
    page.fill("#temperature", "0")
    page.set_input_files("#attach-file", str(image))
    page.fill("#prompt", sample.messages[0]["content"][1]["text"])
    page.press("#prompt", "Enter")
    page.wait_for_function("() => document.querySelectorAll('.turn.assistant').length === 1"
                           " && document.getElementById('conversation').getAttribute('aria-busy') === 'false'")
    expect(page.locator("#error")).to_be_hidden()
    answer = page.locator(".turn.assistant .answer").text_content() or ""
    assert check_image_answer(sample, answer), (sample.expected, answer)
    page.locator(".turn.assistant .thinking summary").click()  # show the scan in the picture
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS.parent / "playground_image.png"))
