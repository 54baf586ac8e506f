"""The dashboard's session over plain HTTP against a real server: sign-in, cookies, CSRF, roles.

A browser's cross-site request is reproduced here as what reaches the server: the session cookie
without the CSRF header (SameSite aside), or a form posted with another site's Origin.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from poolkit import PoolServer
from webkit import make_user

from computepool.server.auth import csrf_token


@pytest.fixture
def browser(server: PoolServer) -> Iterator[httpx.Client]:
    """A cookie-keeping client with no bearer token: what a browser sends."""
    with httpx.Client(base_url=server.url, timeout=10, follow_redirects=False) as c:
        yield c


def sign_in(c: httpx.Client, token: str) -> httpx.Response:
    return c.post("/ui/login", data={"token": token})


def set_cookies(r: httpx.Response) -> dict[str, str]:
    """Set-Cookie headers by cookie name, lower-cased."""
    return {h.split("=", 1)[0]: h.lower() for h in r.headers.get_list("set-cookie")}


def test_signed_out_sees_the_sign_in_page_with_a_strict_csp(browser: httpx.Client) -> None:
    r = browser.get("/")
    assert r.status_code == 200
    assert 'name="token"' in r.text and 'action="/ui/login"' in r.text
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-frame-options"] == "DENY"
    assert "https://" not in r.text  # no CDN: every asset is served by the pool itself
    for page in ("/ui/overview", "/ui/work", "/ui/work/1", "/ui/audit"):
        r = browser.get(page)
        assert (r.status_code, r.headers["location"]) == (303, "/"), page


def test_a_wrong_token_is_refused_and_sets_nothing(browser: httpx.Client, server: PoolServer) -> None:
    for token in ("nonsense", "abcd.efgh", server.token + "x", ""):
        r = sign_in(browser, token)
        assert r.status_code == 401, token
        assert "token refused" in r.text
        assert "set-cookie" not in r.headers
    assert not browser.cookies


def test_sign_in_sets_a_strict_http_only_cookie_and_the_api_accepts_it(
    browser: httpx.Client, server: PoolServer
) -> None:
    r = sign_in(browser, server.token)
    assert (r.status_code, r.headers["location"]) == (303, "/")
    cookies = set_cookies(r)
    session, csrf = cookies["cpool_session"], cookies["cpool_csrf"]
    for c in (session, csrf):
        assert "samesite=strict" in c and "path=/" in c
        assert "secure" not in c  # plain HTTP here; the browser test checks Secure over HTTPS
    assert "httponly" in session and "httponly" not in csrf
    assert browser.cookies["cpool_csrf"] == csrf_token(server.token)
    page = browser.get("/")
    assert page.status_code == 200 and 'id="heatmap"' in page.text
    assert f'<meta name="csrf-token" content="{csrf_token(server.token)}">' in page.text
    who = browser.get("/api/v1/whoami")
    assert who.status_code == 200 and who.json()["role"] == "admin"


def test_a_write_with_the_cookie_needs_the_csrf_token(
    browser: httpx.Client, server: PoolServer, admin: httpx.Client
) -> None:
    sign_in(browser, server.token)
    for headers in ({}, {"X-CSRF-Token": "0" * 64}, {"X-CSRF-Token": csrf_token(server.token + "x")}):
        r = browser.post("/api/v1/tenants", json={"name": "forged"}, headers=headers)
        assert r.status_code == 403, r.text
        assert "missing or wrong CSRF token" in r.json()["error"]
    assert admin.get("/api/v1/tenants/forged").status_code == 404  # nothing was made
    good = {"X-CSRF-Token": browser.cookies["cpool_csrf"]}
    r = browser.post("/api/v1/tenants", json={"name": "madebycookie"}, headers=good)
    assert r.status_code == 201, r.text
    # bearer-token calls are unchanged: no CSRF token, whether or not a session cookie comes along
    r = admin.post("/api/v1/tenants", json={"name": "madebybearer"})
    assert r.status_code == 201, r.text
    bearer = {"Authorization": f"Bearer {server.token}"}
    r = browser.post("/api/v1/tenants", json={"name": "bearerandcookie"}, headers=bearer)
    assert r.status_code == 201, r.text
    # a bearer token, when given, is the credential: a wrong one is not rescued by the cookie
    r = browser.get("/api/v1/whoami", headers={"Authorization": "Bearer abcd.efgh"})
    assert r.status_code == 401


def test_forms_from_another_site_are_refused(browser: httpx.Client, server: PoolServer) -> None:
    for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
        r = browser.post("/ui/login", data={"token": server.token}, headers=headers)
        assert r.status_code == 403 and "another site" in r.text
        assert "set-cookie" not in r.headers
    sign_in(browser, server.token)
    r = browser.post(
        "/ui/logout", data={"csrf": browser.cookies["cpool_csrf"]}, headers={"Origin": "https://evil.example"}
    )
    assert r.status_code == 403
    r = browser.post("/ui/logout", data={"csrf": "wrong"})
    assert r.status_code == 403 and "CSRF" in r.text
    assert browser.get("/api/v1/whoami").status_code == 200  # still signed in
    r = browser.post("/ui/logout", data={"csrf": browser.cookies["cpool_csrf"]})
    assert (r.status_code, r.headers["location"]) == (303, "/")
    assert not browser.cookies
    assert browser.get("/api/v1/whoami").status_code == 401


def test_node_and_scraper_tokens_cannot_sign_in(
    browser: httpx.Client, server: PoolServer, admin: httpx.Client
) -> None:
    join = admin.post("/api/v1/join-tokens", json={}).json()["token"]
    body = {"join_token": join, "name": "webnode", "cpu_milli": 1000, "memory_mib": 1024}
    node_cred = httpx.post(f"{server.url}/api/v1/nodes/join", json=body).json()["credential"]
    scraper = make_user(admin, "prom", "monitoring", "scraper")
    for token in (node_cred, scraper):
        r = sign_in(browser, token)
        assert r.status_code == 401 and "cannot sign in" in r.text
        assert "set-cookie" not in r.headers
        # nor does the API take such a token from a cookie set by hand
        browser.cookies.set("cpool_session", token)
        assert browser.get("/api/v1/whoami").status_code == 401
        browser.cookies.clear()


def test_a_member_sees_only_their_tenants_work(
    browser: httpx.Client, server: PoolServer, admin: httpx.Client
) -> None:
    alice = make_user(admin, "alice", "alpha", "member")
    bob = make_user(admin, "bob", "beta", "member")
    ask = {"cpu_milli": 100, "name": "alphas-job", "command": ["true"]}
    r = httpx.post(f"{server.url}/api/v1/allocations", json=ask, headers={"Authorization": f"Bearer {alice}"})
    assert r.status_code == 201, r.text
    alloc = r.json()["id"]
    sign_in(browser, bob)
    page = browser.get(f"/ui/work/{alloc}")
    assert page.status_code == 404 and f"allocation &#39;{alloc}&#39; not found" in page.text
    missing = browser.get("/ui/work/999999")
    assert missing.status_code == 404 and "allocation &#39;999999&#39; not found" in missing.text
    assert browser.get(f"/api/v1/allocations/{alloc}").status_code == 404
    assert [a["id"] for a in browser.get("/api/v1/allocations").json()["items"]] == []
    csrf = {"X-CSRF-Token": browser.cookies["cpool_csrf"]}
    assert browser.post(f"/api/v1/allocations/{alloc}/cancel", headers=csrf).status_code == 404
    browser.cookies.clear()
    sign_in(browser, alice)
    assert browser.get(f"/ui/work/{alloc}").status_code == 200
    assert [a["id"] for a in browser.get("/api/v1/allocations").json()["items"]] == [alloc]
    assert browser.get("/api/v1/audit").status_code == 403


def test_a_revoked_tokens_session_ends(browser: httpx.Client, admin: httpx.Client) -> None:
    token = make_user(admin, "carol", "alpha", "viewer")
    sign_in(browser, token)
    assert browser.get("/api/v1/whoami").status_code == 200
    r = admin.delete(f"/api/v1/tokens/{token.split('.', 1)[0]}")
    assert r.status_code in (200, 204), r.text
    assert browser.get("/api/v1/whoami").status_code == 401
    page = browser.get("/")
    assert page.status_code == 200 and 'action="/ui/login"' in page.text


def test_assets_ship_in_the_package(browser: httpx.Client) -> None:
    js = browser.get("/ui/static/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "X-CSRF-Token" in js.text and "innerHTML" not in js.text
    css = browser.get("/ui/static/style.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    for name in ("pages.py", "..%2fpages.py", "..%2f..%2fauth.py", "base.html", "../session.py"):
        r = browser.get(f"/ui/static/{name}")
        assert r.status_code in (303, 404) and "import" not in r.text, name  # 303: the URL normalised


def test_unknown_pages_and_ids_are_not_found(browser: httpx.Client, server: PoolServer) -> None:
    sign_in(browser, server.token)
    assert browser.get("/ui/nowhere").status_code == 404
    for bad in ("abc", "0", "-1", "9" * 30):
        r = browser.get(f"/ui/work/{bad}")
        assert r.status_code == 404 and "not found" in r.text, bad
