"""``/docs`` is sent with a Content-Security-Policy and anti-framing headers, and Swagger UI still
renders under them, offline, in a real browser (issue 42, item 10).

The browser half drives Debian's chromium headless through Playwright against a real server, as
the console's browser test does: it skips where chromium or playwright is missing, except in CI
(``KVSTORE_CI=1``), where it fails. A page that violates its policy logs a console error ("Refused
to execute inline script ..."), which fails the test.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

import httpx
import pytest

from kvstore import config
from served import ServeProcess

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking"]


@pytest.fixture
def server(tmp_path):
    process = ServeProcess(tmp_path / "data", env={"KVSTORE_API_KEYS": "docs-key-0123456789abcdef:alice"}).start()
    try:
        yield process
    finally:
        process.stop_cleanly()


def policy_of(answer: httpx.Response) -> dict[str, str]:
    directives = [part.strip() for part in answer.headers["content-security-policy"].split(";") if part.strip()]
    return {name: rest for name, _, rest in (d.partition(" ") for d in directives)}


def test_docs_carry_a_policy_that_allows_exactly_their_inline_script_and_no_framing(server):
    answer = httpx.get(server.url + "/docs", timeout=60)
    assert answer.status_code == 200
    policy = policy_of(answer)
    assert answer.headers["x-frame-options"] == "DENY" and policy["frame-ancestors"] == "'none'"
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'" and policy["style-src"] == "'self'"
    inline = re.findall(r"<script>(.*?)</script>", answer.text, flags=re.DOTALL)
    assert len(inline) == 1 and "SwaggerUIBundle(" in inline[0]
    digest = base64.b64encode(hashlib.sha256(inline[0].encode()).digest()).decode()
    assert policy["script-src"].split() == ["'self'", f"'sha256-{digest}'"]  # that script, nothing else inline
    assert "unsafe-inline" not in answer.headers["content-security-policy"]


def _browser_or_skip():
    missing = None
    if not CHROMIUM.exists():
        missing = f"chromium is not installed ({CHROMIUM})"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "playwright is not installed (the `test` extra)"
    if missing is not None:
        if config.CI.get():
            pytest.fail(f"{missing}: CI runs the browser tests")
        pytest.skip(missing)


def test_swagger_ui_renders_under_the_policy_in_a_browser(server):
    _browser_or_skip()
    from playwright.sync_api import expect, sync_playwright

    errors: list[str] = []
    elsewhere: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(60_000)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)

            def only_local(route):
                if route.request.url.startswith((server.url, "data:", "blob:")):
                    route.continue_()
                else:
                    elsewhere.append(route.request.url)
                    route.abort()

            page.route("**/*", only_local)
            page.goto(server.url + "/docs")
            expect(page.locator(".swagger-ui .info .title")).to_contain_text("kvstore")
            expect(page.locator(".opblock-summary-path", has_text="/sessions/{session_id}/file/inspect")).to_have_count(
                1
            )
            page.locator(".opblock-summary-path", has_text="/sessions/{session_id}/file/inspect").click()
            expect(page.locator(".opblock-body").first).to_be_visible()  # an operation opens (scripts run)
            # a page that frames /docs gets nothing: the browser refuses to render it in the frame
            framed = browser.new_page()
            framed.set_content(f'<iframe id="f" src="{server.url}/docs"></iframe>')
            framed.wait_for_timeout(2000)
            frame = framed.frame(url=re.compile(r".*/docs$"))
            assert frame is None or frame.locator(".swagger-ui").count() == 0
        finally:
            browser.close()
    assert elsewhere == [], elsewhere
    assert errors == [], errors
