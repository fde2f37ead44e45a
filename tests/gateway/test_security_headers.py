"""/admin (page, assets, API, errors) sends a Content-Security-Policy, X-Frame-Options: DENY, nosniff and a
Referrer-Policy; the dashboard runs under that policy in Chromium without a single violation."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gateway.http.middleware import ADMIN_CSP
from tests.gateway.admin_stack import start_admin_stack
from tests.gateway.test_dashboard_browser import CHROMIUM, CHROMIUM_ARGS


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    s = start_admin_stack(llama_dir, tmp_path_factory.mktemp("gateway"))
    yield s
    s.stop()


def _assert_admin_headers(resp: httpx.Response) -> None:
    csp = resp.headers["content-security-policy"]
    assert csp == ADMIN_CSP
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["script-src"] == "'self'" and directives["default-src"] == "'none'"
    assert directives["frame-ancestors"] == "'none'" and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert resp.headers["x-frame-options"] == "DENY"
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert resp.headers["referrer-policy"] == "no-referrer"
    assert len(resp.headers.get_list("content-security-policy")) == 1


@pytest.mark.parametrize("path", ["/admin", "/admin/", "/admin/static/app.js", "/admin/static/app.css"])
def test_dashboard_page_and_assets(stack, path):
    resp = httpx.get(stack.url + path, timeout=30)
    assert resp.status_code == 200
    _assert_admin_headers(resp)


def test_admin_api_and_its_errors(stack):
    ok = httpx.get(stack.url + "/admin/api/tenants", headers=stack.admin_headers(), timeout=30)
    assert ok.status_code == 200
    _assert_admin_headers(ok)
    for resp in (httpx.get(stack.url + "/admin/api/tenants", timeout=30),  # no key: 401
                 httpx.get(stack.url + "/admin/api/tenants", timeout=30,
                           headers={"authorization": f"Bearer {stack.tenant_key}"}),  # not an admin: 403
                 httpx.get(stack.url + "/admin/static/nothing.js", timeout=30)):  # 404
        assert resp.status_code in (401, 403, 404), resp.text
        _assert_admin_headers(resp)


def test_the_tenant_api_is_nosniff_without_the_page_policy(stack):
    resp = httpx.get(stack.url + "/v1/models", headers={"authorization": f"Bearer {stack.tenant_key}"}, timeout=30)
    assert resp.status_code == 200
    assert resp.headers["x-content-type-options"] == "nosniff"
    assert "content-security-policy" not in resp.headers


@pytest.mark.browser
def test_the_dashboard_works_under_its_policy(stack, tmp_path: Path):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is not installed at /usr/bin/chromium (apt-get install chromium)")
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        violations: list[str] = []
        page.on("console", lambda msg: violations.append(msg.text) if "Content Security Policy" in msg.text else None)
        page.add_init_script("document.addEventListener('securitypolicyviolation', "
                             "e => console.error('Content Security Policy violation: ' + e.violatedDirective))")
        page.goto(stack.url + "/admin")
        page.fill("#login-key", stack.admin_key)
        page.click("#login-submit")
        expect(page.locator("#app")).to_be_visible()
        assert stack.chat(stack.tenant_key, max_tokens=2).status_code == 200
        expect(page.locator("#kpi-requests")).not_to_have_text("0", timeout=15_000)
        expect(page.locator('tr[data-tenant="acme"]')).to_be_visible()
        bars = page.locator("div.bar > span")  # the workers' KV bars: widths set through the CSSOM
        expect(bars.first).to_be_attached(timeout=15_000)
        assert bars.first.evaluate("el => el.style.width").endswith("%")
        browser.close()
    assert violations == []
