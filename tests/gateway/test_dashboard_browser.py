"""The dashboard in Debian's headless Chromium against a live gateway: sign in, watch the overview move
with traffic, edit a tenant's requests/min inline, and see that tenant refused at the new limit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.gateway.admin_stack import start_admin_stack

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
NEW_LIMIT = 3


@pytest.mark.browser
def test_operator_edits_a_limit_and_the_gateway_enforces_it(llama_dir, tmp_path):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is not installed at /usr/bin/chromium (apt-get install chromium)")
    from playwright.sync_api import expect, sync_playwright

    stack = start_admin_stack(llama_dir, tmp_path / "gateway")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.goto(stack.url + "/admin")

            page.fill("#login-key", stack.tenant_key)  # a tenant key is not enough
            page.click("#login-submit")
            expect(page.locator("#login-error")).to_have_text("This key is not an admin key.")
            page.fill("#login-key", stack.admin_key)
            page.click("#login-submit")
            expect(page.locator("#app")).to_be_visible()
            expect(page.locator("#whoami")).to_contain_text("operators")
            expect(page.locator("#worker-pill")).to_have_text("worker up · tiny-llama")
            expect(page.locator("#kpi-requests")).to_have_text("0")
            expect(page.locator("#chart-tps")).to_have_attribute("data-nonzero", "0")

            for i in range(4):
                assert stack.chat(stack.tenant_key, content=f"tell me about caches {i % 2}", max_tokens=6).status_code == 200
            expect(page.locator("#kpi-requests")).to_have_text("4", timeout=15_000)
            expect(page.locator("#chart-tps")).not_to_have_attribute("data-nonzero", "0")
            expect(page.locator("#kpi-ttft")).not_to_have_text("–")
            expect(page.locator("#kpi-hits")).not_to_have_text("–")
            expect(page.locator('tr[data-tenant="acme"]')).to_contain_text("4 / 60", timeout=15_000)

            page.click('[data-testid="rpm-limit-acme"]')
            page.fill('[data-testid="rpm-input-acme"]', str(NEW_LIMIT))
            page.press('[data-testid="rpm-input-acme"]', "Enter")
            expect(page.locator("#toast")).to_contain_text(f"requests per minute set to {NEW_LIMIT}")
            expect(page.locator('[data-testid="rpm-limit-acme"]')).to_have_text(str(NEW_LIMIT))
            assert stack.store.get_tenant(stack.tenant.id).policy.overrides() == {"requests_per_minute": NEW_LIMIT}
            expect(page.locator("#audit-table")).to_contain_text("tenant.policy.update")

            statuses = [stack.chat(stack.tenant_key, max_tokens=2).status_code for _ in range(NEW_LIMIT + 2)]
            assert statuses == [200] * NEW_LIMIT + [429, 429]
            expect(page.locator("#kpi-requests-sub")).to_contain_text("2 refused", timeout=15_000)
            expect(page.locator("#audit-table")).to_contain_text(f"requests_per_minute: null → {NEW_LIMIT}")

            expect(page.locator('tr[data-tenant="acme"]')).to_contain_text(f"9 / {NEW_LIMIT}", timeout=15_000)
            page.evaluate("document.getElementById('toast').hidden = true")
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copyfile(shot, ARTIFACTS / "dashboard.png")
        assert shot.stat().st_size > 10_000
    finally:
        stack.stop()
