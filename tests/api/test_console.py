"""The web console (``GET /``) and the offline ``/docs``, over a real uvicorn server on 127.0.0.1.

The HTTP tests run everywhere. The browser test drives Debian's chromium headless through
Playwright (no browser download): it skips where ``/usr/bin/chromium`` or playwright is missing,
except in CI (``KVSTORE_CI=1``, set by ``.ci/run``, which installs chromium), where it fails instead.
Its screenshots are saved under ``test-artifacts/`` at the repository root.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvstore import config, tiers
from served import wait_job
from store.support import MODEL, Rows

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = ROOT / "api" / "console"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
GEOMETRY_JSON = {"n_layers": 2, "kv_lora": 32, "qk_rope": 8, "index_hd": 4, "nic": 1, "vocab": 1000}
RAW = "application/octet-stream"
HOSTILE_NAME = "<img src=x onerror=\"document.title='owned'\"><script>window.owned=1</script>"
MEDIA = {".js": "javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json"}


class References(HTMLParser):
    """Every ``src``/``href`` of a page, and its inline scripts."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []
        self.inline_scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        values = dict(attrs)
        self.urls += [values[name] for name in ("src", "href") if values.get(name)]
        self._in_script = tag == "script" and not values.get("src")

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.inline_scripts.append(data)


def references(html: str) -> References:
    parser = References()
    parser.feed(html)
    return parser


def make_session(client, sid, turns=(12, 7), *, tier="fp8", model=None, seed=0):
    response = client.post(
        "/sessions", json={"id": sid, "model": model or MODEL, "geometry": GEOMETRY_JSON, "tier": tier}
    )
    assert response.status_code == 201, response.text
    rows = Rows(seed)
    for n in turns:
        response = client.post(
            f"/sessions/{sid}/append", content=rows.encode(tiers.get(tier), rows.make(n)), headers={"Content-Type": RAW}
        )
        assert response.status_code == 200, response.text
    return response.json()["session"] if turns else None


# ---------------------------------------------------------------------------- the page over HTTP
def test_the_page_and_its_files_are_served_with_a_strict_content_security_policy(server):
    with server.client(None) as anonymous:
        page = anonymous.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "default-src 'none'" in policy
        assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
        assert page.headers["x-content-type-options"] == "nosniff"
        found = references(page.text)
        assert found.inline_scripts == []  # the policy would refuse them anyway
        local = [url for url in found.urls if not url.startswith("data:") and not url.startswith("#")]
        assert local and all(url.startswith("/console/assets/") for url in local), found.urls
        # the modules the page loads, and the ones they import
        modules = set(local)
        for url in list(local):
            if url.endswith(".js"):
                body = anonymous.get(url).text
                modules |= {f"/console/assets/{name}" for name in re.findall(r'from "\./([a-z]+\.js)"', body)}
        for url in sorted(modules):
            response = anonymous.get(url)
            assert response.status_code == 200, url
            assert MEDIA[Path(url).suffix] in response.headers["content-type"], (url, response.headers["content-type"])
            assert "script-src 'self'" in response.headers["content-security-policy"]
        assert {Path(url).name for url in modules} == {p.name for p in CONSOLE.iterdir() if p.suffix in (".js", ".css")}
        for name in ("nothing.js", "..%2Fmain.py", "index.html"):
            missing = anonymous.get(f"/console/assets/{name}")
            assert missing.status_code == 404 and missing.json()["error"] == "NotFound"


def test_the_console_scripts_never_write_markup_and_name_no_other_host():
    scripts = {p.name: p.read_text() for p in CONSOLE.glob("*.js")}
    assert scripts
    for name, text in scripts.items():
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
            assert sink not in text, (name, sink)
        # the SVG namespace is a name, not a place anything is fetched from
        assert set(re.findall(r"https?://[^\s\"'`]+", text)) <= {"http://www.w3.org/2000/svg"}, name
    html = (CONSOLE / "index.html").read_text()
    assert not re.search(r"https?://", html)


def test_docs_render_from_local_files_only(server):
    with server.client(None) as anonymous:
        docs = anonymous.get("/docs")
        assert docs.status_code == 200
        urls = references(docs.text).urls
        assert not re.search(r"(https?:)?//", docs.text.replace("window.location.origin", "")), docs.text
        assets = [url for url in urls if url.startswith("/docs/assets/")]
        assert len(assets) == len(urls) == 3, urls  # the bundle, the style sheet, the icon
        for url in assets:
            response = anonymous.get(url)
            assert response.status_code == 200 and len(response.content) > 0, url
            assert MEDIA[Path(url).suffix] in response.headers["content-type"], (url, response.headers["content-type"])
        assert "'/openapi.json'" in docs.text
        assert anonymous.get("/openapi.json").json()["info"]["title"] == "kvstore"
        assert anonymous.get("/redoc").status_code == 404  # ReDoc loads from a CDN: not served
        assert anonymous.get("/docs/assets/../keys.json").status_code == 404


# ---------------------------------------------------------------------------- the console's JSON routes
def test_console_routes_report_owner_disk_use_and_activity(make_server, keys):
    server = make_server("--budget", "1M", "--hard-limit", "4M")
    with server.client(keys["alice"]) as alice, server.client(keys["bob"]) as bob, server.client(None) as anonymous:
        for path in ("/console/me", "/console/store", "/console/activity"):
            assert anonymous.get(path).status_code == 401
        assert alice.get("/console/me").json()["owner"] == "alice"
        make_session(alice, "a1")
        make_session(alice, "a2", (5,), tier="int4")
        make_session(bob, "b1", (30,))
        wait_job(alice, alice.post("/sessions/a2/park").json(), expect="done")
        sizes = {s["id"]: s["size_bytes"] for s in alice.get("/sessions").json()["sessions"]}
        bob_size = bob.get("/sessions/b1").json()["size_bytes"]
        store = alice.get("/console/store").json()
        assert store["budget_bytes"] == 1 << 20 and store["hard_limit_bytes"] == 4 << 20
        assert store["mine"]["active"] == {"sessions": 1, "bytes": sizes["a1"]}
        assert store["mine"]["parked"] == {"sessions": 1, "bytes": sizes["a2"]}
        assert store["mine"]["damaged"] == {"sessions": 0, "bytes": 0}
        assert store["mine_by_tier"] == {
            "fp8": {"sessions": 1, "bytes": sizes["a1"]},
            "int4": {"sessions": 1, "bytes": sizes["a2"]},
        }
        assert store["store"]["active"] == {"sessions": 2, "bytes": sizes["a1"] + bob_size}
        assert store["used_bytes"] == sizes["a1"] + sizes["a2"] + bob_size
        assert "bob" not in json.dumps(store) and "b1" not in json.dumps(store)

        assert alice.get("/console/activity").json()["sessions"] == {}
        resumed = alice.get("/sessions/a1/resume", params={"verify": "true"})
        assert resumed.status_code == 200
        assert alice.get("/sessions/a1/verify").json()["ok"] is True
        assert bob.get("/sessions/a1/verify").status_code == 404  # bob has no a1: nothing recorded
        assert bob.get("/sessions/b1/resume").status_code == 200
        mine = alice.get("/console/activity").json()["sessions"]
        assert list(mine) == ["a1"]
        events = mine["a1"]["events"]
        assert [e["kind"] for e in events] == ["resume", "verify"]
        assert events[0]["reused_tokens"] == 19 and events[0]["format"] == "raw"
        assert events[0]["verified"] is True and events[0]["ok"] is True
        assert events[1]["turns_checked"] == 2 and events[1]["good_records"] == 19
        assert mine["a1"]["last_verify"] == events[1]
        assert list(bob.get("/console/activity").json()["sessions"]) == ["b1"]

        # damage found by verify is shown as the last verify; a delete forgets the session's activity
        journal = server.data / "journals" / "a1~alice.coli_kv"
        body = bytearray(journal.read_bytes())
        body[-3] ^= 0x01
        journal.write_bytes(body)
        report = alice.get("/sessions/a1/verify").json()
        assert report["ok"] is False
        last = alice.get("/console/activity").json()["sessions"]["a1"]["last_verify"]
        assert last["ok"] is False and last["damaged_from"] == report["first_bad"]["start"] == 12
        assert alice.delete("/sessions/a1").status_code == 204
        assert "a1" not in alice.get("/console/activity").json()["sessions"]


# ---------------------------------------------------------------------------- in a real browser
def _browser_or_skip():
    missing = None
    if not CHROMIUM.exists():
        missing = f"chromium is not installed ({CHROMIUM}; `apt-get install -y chromium`)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "playwright is not installed (the `test` extra)"
    if missing is not None:
        if config.CI.get():
            pytest.fail(f"{missing}: CI runs the browser test (.ci/run installs chromium)")
        pytest.skip(missing)


@pytest.fixture
def browser():
    _browser_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


#: How long the browser waits for an element or an expectation before failing (default 5 s, short
#: for a job that runs beside the rest of the suite on two cores).
WAIT_MS = 60_000


class Watched:
    """A page that may talk to the server under test only, and must log no error."""

    def __init__(self, browser, base: str, viewport: dict[str, int], timezone_id: str | None = None):
        self.context = browser.new_context(viewport=viewport, accept_downloads=True, timezone_id=timezone_id)
        self.page = self.context.new_page()
        # waits, not timings: a park job or a page load may take seconds on a loaded 2-core runner
        self.page.set_default_timeout(WAIT_MS)
        self.elsewhere: list[str] = []
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("console", lambda msg: self.errors.append(msg.text) if msg.type == "error" else None)

        def only_local(route):
            if route.request.url.startswith(base) or route.request.url.startswith(("data:", "blob:")):
                route.continue_()
            else:
                self.elsewhere.append(route.request.url)
                route.abort()

        self.page.route("**/*", only_local)

    def check(self):
        assert self.elsewhere == [], self.elsewhere
        # the one expected console error: the refused key of the first sign-in attempt (401)
        unexpected = [e for e in self.errors if "401" not in e]
        assert unexpected == [], unexpected

    def close(self):
        self.context.close()


def test_the_console_in_a_browser(browser, make_server, keys):
    from playwright.sync_api import expect

    expect.set_options(timeout=WAIT_MS)  # how long an expectation waits (a bound, not a timing)

    server = make_server("--budget", "1M", "--hard-limit", "4M")
    with server.client(keys["alice"]) as alice, server.client(keys["bob"]) as bob:
        make_session(alice, "chat-a", (12, 7))
        make_session(alice, "chat-b", (5,), tier="int4", seed=1)
        make_session(alice, "hostile", (3,), model={"name": HOSTILE_NAME, "revision": "r1"}, seed=2)
        make_session(bob, "bobs-chat", (9,), seed=3)
    ARTIFACTS.mkdir(exist_ok=True)
    wide = Watched(browser, server.url, {"width": 1280, "height": 800})
    page = wide.page
    try:
        page.goto(server.url + "/")
        expect(page.get_by_role("heading", name="Sign in")).to_be_visible()

        # sign in with the keyboard alone: a wrong key first, then the right one
        page.keyboard.press("Tab")
        expect(page.get_by_role("link", name="Skip to content")).to_be_focused()
        page.keyboard.press("Tab")
        expect(page.locator("#api-key")).to_be_focused()
        outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
        assert outline not in ("none", ""), outline
        page.keyboard.type("not-a-key-0000000000000000")
        page.keyboard.press("Enter")
        expect(page.locator("#signin-error")).to_have_text("This key is not accepted.")
        expect(page.locator("#api-key")).to_be_focused()
        page.keyboard.press("Control+A")
        page.keyboard.type(keys["alice"])
        page.keyboard.press("Enter")
        expect(page.locator("#who-owner")).to_have_text("Signed in as alice")
        expect(page.locator("#sessions-title")).to_be_focused()
        assert page.evaluate("sessionStorage.getItem('kvstore.console.key')") == keys["alice"]

        # the owner's sessions only, with tier, tokens, size, last use and verify status
        rows = page.locator("table.sessions tbody tr")
        expect(rows).to_have_count(3)
        expect(page.locator(".session-link")).to_have_text(["chat-a", "chat-b", "hostile"])
        first = rows.nth(0)
        expect(first.locator('[data-label="Tier"]')).to_have_text("fp8")
        expect(first.locator('[data-label="Tokens"]')).to_have_text("19")
        expect(first.locator('[data-label="Verify"]')).to_have_text("not verified")
        assert "bobs-chat" not in page.locator("#sessions").inner_text()

        # open a session with the keyboard: Refresh, then the first session's link
        page.keyboard.press("Tab")
        page.keyboard.press("Tab")
        expect(page.get_by_role("link", name="chat-a", exact=True)).to_be_focused()
        page.keyboard.press("Enter")
        expect(page.locator("#detail-title")).to_have_text("Session chat-a")
        expect(page.locator("#detail-title")).to_be_focused()
        detail = page.locator("#detail")
        expect(detail).to_contain_text("2 layers × kv_lora 32 + rope 8, indexer 1 × 4, vocab 1,000")
        fingerprint = alice_get(server, keys, "/sessions/chat-a")["fingerprint"]
        expect(page.locator("#fingerprint")).to_have_text(fingerprint)
        expect(detail).to_contain_text("The file has no structural problem.")

        # verify, and see its result in the detail and the list
        page.get_by_role("button", name="Verify").click()
        expect(page.locator("#detail-message")).to_have_text("Verified chat-a: 2 turns, 19 records intact.")
        expect(first.locator('[data-label="Verify"]')).to_contain_text("ok")
        expect(detail).to_contain_text("Last verify")
        expect(page.locator("table.events tbody tr")).to_have_count(1)

        # export: the download is the session as a .coli_kv file, byte for byte
        with page.expect_download() as download_info:
            page.get_by_role("button", name="Export .coli_kv").click()
        download = download_info.value
        assert download.suggested_filename == "chat-a.coli_kv"
        saved = Path(download.path()).read_bytes()
        with server.client(keys["alice"]) as alice:
            assert saved == alice.get("/sessions/chat-a/resume", params={"format": "coli_kv"}).content
        expect(page.locator("#detail-message")).to_contain_text("Exported chat-a.coli_kv")

        # fork under a chosen id: the new session opens, the list and its parent show the link
        page.get_by_label("Fork as new id (optional)").fill("chat-a-fork")
        page.get_by_role("button", name="Fork", exact=True).click()
        expect(page.locator("#detail-title")).to_have_text("Session chat-a-fork")
        expect(detail).to_contain_text("Forked from chat-a at record 19.")
        expect(rows).to_have_count(4)

        # park chat-b: a job with progress; the chart's archive tier grows
        page.locator(".session-link", has_text="chat-b").click()
        expect(page.locator("#detail-title")).to_have_text("Session chat-b")
        page.get_by_role("button", name="Park").click()
        expect(page.locator("table.jobs tbody tr").first.locator('[data-label="State"]')).to_contain_text("done")
        expect(page.locator("table.jobs progress").first).to_have_attribute("value", "100")
        expect(page.get_by_role("button", name="Unpark")).to_be_visible()
        parked = alice_get(server, keys, "/sessions/chat-b")
        assert parked["state"] == "parked"
        figures = page.locator("#store-figures")
        expect(figures).to_contain_text("Archive tier (parked)")
        archive = figures.locator("div", has_text="Archive tier (parked)").locator("dd")
        expect(archive).not_to_have_text(re.compile(r"^0 B"))
        chart = page.locator("#store-chart svg")
        expect(chart.locator("rect.seg-parked")).to_have_count(2)  # all owners, and yours
        expect(chart.locator(".marker.budget")).to_have_count(1)
        expect(chart.locator(".marker.limit")).to_have_count(1)

        # delete with confirmation: cancel once (nothing deleted), then confirm
        page.get_by_role("button", name="Delete…").click()
        dialog = page.locator("#confirm-delete")
        expect(dialog).to_be_visible()
        expect(dialog).to_contain_text("Delete session chat-b and its files?")
        expect(page.locator("#confirm-cancel")).to_be_focused()
        page.keyboard.press("Enter")  # Cancel has the focus
        expect(dialog).to_be_hidden()
        expect(page.locator("#detail-message")).to_have_text("Kept chat-b.")
        assert alice_get(server, keys, "/sessions/chat-b")["id"] == "chat-b"
        page.get_by_role("button", name="Delete…").click()
        page.keyboard.press("Escape")  # Escape cancels too
        expect(dialog).to_be_hidden()
        assert alice_get(server, keys, "/sessions/chat-b")["id"] == "chat-b"
        page.get_by_role("button", name="Delete…").click()
        dialog.get_by_role("button", name="Delete", exact=True).click()
        expect(page.locator("#flash")).to_have_text("Deleted chat-b.")
        expect(rows).to_have_count(3)
        expect(page.locator("#detail")).to_be_hidden()
        with server.client(keys["alice"]) as alice:
            assert alice.get("/sessions/chat-b").status_code == 404

        # server strings are text, never markup
        page.locator(".session-link", has_text="hostile").click()
        expect(detail).to_contain_text(HOSTILE_NAME)
        assert page.locator("#detail img, #detail script").count() == 0
        assert page.evaluate("window.owned") is None and page.title() == "kvstore console"

        page.locator(".session-link", has_text="chat-a").first.click()
        expect(page.locator("#detail-title")).to_have_text("Session chat-a")
        page.screenshot(path=str(ARTIFACTS / "console-1280x800.png"))
        wide.check()
        key = page.evaluate("sessionStorage.getItem('kvstore.console.key')")
    finally:
        wide.close()

    # a phone: the same page in one column, nothing wider than the screen
    phone = Watched(browser, server.url, {"width": 390, "height": 844})
    page = phone.page
    try:
        page.goto(server.url + "/")
        page.get_by_label("API key").fill(key)
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator(".session-link")).to_have_count(3)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        page.screenshot(path=str(ARTIFACTS / "console-390x844.png"), full_page=True)
        page.locator(".session-link", has_text="chat-a").first.click()
        expect(page.locator("#detail-title")).to_have_text("Session chat-a")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        page.locator("#detail").screenshot(path=str(ARTIFACTS / "console-390x844-detail.png"))
        page.get_by_role("button", name="Sign out").click()
        expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
        assert page.evaluate("sessionStorage.getItem('kvstore.console.key')") is None
        phone.check()
    finally:
        phone.close()

    # /docs renders Swagger UI with no request leaving the machine
    docs = Watched(browser, server.url, {"width": 1280, "height": 800})
    try:
        docs.page.goto(server.url + "/docs")
        expect(docs.page.locator(".swagger-ui .info .title")).to_contain_text("kvstore")
        expect(docs.page.locator(".opblock-summary-path", has_text="/sessions/{session_id}/verify")).to_have_count(1)
        docs.page.screenshot(path=str(ARTIFACTS / "docs-1280x800.png"))
        docs.check()
    finally:
        docs.close()


def alice_get(server, keys, path: str) -> dict:
    with server.client(keys["alice"]) as alice:
        response = alice.get(path)
        assert response.status_code == 200, response.text
        return response.json()


def test_the_console_of_a_store_without_a_budget_reads_as_a_newcomer_expects(browser, make_server, keys):
    """One session and no budget (what `make run` gives): counts in the singular, a chart that does
    not look full, the tier named once, times with their zone, no file names of the store's own, and
    a sign-in help that says what to do about a lost key."""
    from playwright.sync_api import expect

    expect.set_options(timeout=WAIT_MS)
    server = make_server()
    with server.client(keys["alice"]) as alice:
        make_session(alice, "chat-a", (12, 7))
    ARTIFACTS.mkdir(exist_ok=True)
    # a zone that is not the machine's: the times must say which one they are in
    watched = Watched(browser, server.url, {"width": 1280, "height": 800}, timezone_id="Asia/Kolkata")
    page = watched.page
    try:
        page.goto(server.url + "/")
        help_text = page.locator("#api-key-help")
        expect(help_text).to_contain_text("kvstore keys create --owner NAME --data DIR")
        page.get_by_label("API key").fill(keys["alice"])
        page.get_by_role("button", name="Sign in").click()
        expect(page.locator(".session-link")).to_have_count(1)

        figures = page.locator("#store-figures")
        journals = figures.locator("div", has_text="Journals (active)").locator("dd")
        expect(journals).to_have_text(re.compile(r" · 1 session$"))
        expect(figures.locator("div", has_text="Yours, fp8").locator("dd")).to_have_text(re.compile(r" · 1 session$"))
        expect(figures.locator("div", has_text="Damaged").locator("dd")).to_have_text(re.compile(r" · 0 sessions$"))

        # no capacity to fill: no track behind the bars, and the bars take at most half the axis
        chart = page.locator("#store-chart svg")
        expect(chart.locator(".no-budget")).to_have_text("no budget or limit set")
        assert chart.locator("rect.track").count() == 0
        widths = page.evaluate(
            """() => {
                const svg = document.querySelector('#store-chart svg');
                const used = [...svg.querySelectorAll('.bar')][0];
                const filled = [...used.querySelectorAll('rect')].reduce((w, r) => w + Number(r.getAttribute('width')), 0);
                const ticks = [...svg.querySelectorAll('text.tick:not(.no-budget)')].map((t) => Number(t.getAttribute('x')));
                return { filled, axis: Math.max(...ticks) - Math.min(...ticks) };
            }"""
        )
        assert 0 < widths["filled"] <= widths["axis"] / 2, widths

        page.locator(".session-link", has_text="chat-a").click()
        detail = page.locator("#detail")
        expect(page.locator("#detail-title")).to_have_text("Session chat-a")
        tier = detail.locator(".facts div", has_text="Tier").locator("dd")
        expect(tier).to_have_text("fp8 (v2, e4m3 codes + f32 scale)")
        created = detail.locator(".facts div", has_text="Created").locator("dd")
        expect(created).to_have_text(re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\+05:30$"))
        expect(detail).to_contain_text("Journal: ")
        expect(detail).to_contain_text("2 turns, 19 loadable records.")
        text = detail.inner_text()
        assert "~alice" not in text and "journals/" not in text, text  # the store's own file name
        page.get_by_role("button", name="Verify").click()
        expect(page.locator("#detail-message")).to_have_text("Verified chat-a: 2 turns, 19 records intact.")
        page.screenshot(path=str(ARTIFACTS / "console-no-budget-1280x800.png"))
        watched.check()
    finally:
        watched.close()


def test_the_console_shows_sessions_a_page_at_a_time(browser, make_server, keys, tmp_path):
    """More sessions than a page (issue 42, item 5): the first 100, oldest first, and "Show more
    sessions" reads the next page; a refresh keeps as many shown."""
    from playwright.sync_api import expect

    import kvstore.store
    from store.support import new_session

    expect.set_options(timeout=WAIT_MS)
    data = tmp_path / "data"
    with kvstore.store.open(data) as store:
        for i in range(130):
            new_session(store, f"s{i:03d}", owner="alice")
    server = make_server(data=data)
    watched = Watched(browser, server.url, {"width": 1280, "height": 800})
    page = watched.page
    try:
        page.goto(server.url + "/")
        page.get_by_label("API key").fill(keys["alice"])
        page.get_by_role("button", name="Sign in").click()
        links = page.locator(".session-link")
        expect(links).to_have_count(100)
        expect(links.first).to_have_text("s000")
        expect(links.last).to_have_text("s099")
        expect(page.locator("#sessions .more")).to_contain_text("100 sessions shown, oldest first")
        page.get_by_role("button", name="Show more sessions").click()
        expect(links).to_have_count(130)
        expect(links.last).to_have_text("s129")
        expect(page.get_by_role("button", name="Show more sessions")).to_have_count(0)
        page.get_by_role("button", name="Refresh").click()
        expect(links).to_have_count(130)
        watched.check()
    finally:
        watched.close()
