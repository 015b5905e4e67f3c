"""The swarm page at / in a real browser (headless Chromium through Selenium).

A 3-shard swarm ([0, 10), [10, 20), [20, 30) of the default model) behind a gateway with an API key:
  - the page's files are served without a key, with their Content-Type, a Content-Security-Policy
    allowing only the gateway itself, an ETag that revalidates to 304, and the Host check still applies;
  - the page asks for the key once, then lists the three members as active, drawn in the chain picture;
  - the chat box streams an answer: the text grows over several DOM updates, then completes;
  - a 4th shard joining with a span of its own appears within seconds, and a killed one turns "gone".
A static chain (--hop) behind a gateway without keys: the page asks for no key and shows the hops.
Set FUSION_PAGE_SCREENSHOT=PATH to save a 1200x800 screenshot of the 3-shard page there
(docs/swarm-page.png is made that way). Skips when chromium, chromedriver or selenium is absent
(scripts/setup.sh installs them).
"""
import contextlib
import http.client
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from shard_cluster import SECRET, Shard, default_model, program, stop_process, swarm_cluster, wait_for

KEY = "page-test-key"
SPANS = {"a": (0, 10), "b": (10, 20), "c": (20, 30)}


def browser_paths():
    """(chromium, chromedriver) or a skip naming what is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver")
                                              else None)
    if not chromium or not driver:
        pytest.skip("chromium and chromium-driver are not installed (scripts/setup.sh installs them)")
    if importlib.util.find_spec("selenium") is None:
        pytest.skip("selenium is not installed (tests/requirements.txt)")
    return chromium, driver


def start_browser(chromium, driver_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    opts = Options()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1200,800",
              "--hide-scrollbars"):
        opts.add_argument(a)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1200, "height": 800, "deviceScaleFactor": 1, "mobile": False})
    return driver


def get(gw, path, headers=None, method="GET"):
    """One raw request to the gateway: (status, headers as a dict, body bytes)."""
    c = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=10)
    try:
        c.request(method, path, headers=headers or {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def check_static_files(gw):
    """The files need no key, carry their type, CSP and ETag, and the Host check still refuses strangers."""
    types = {"/": "text/html", "/app.js": "text/javascript", "/style.css": "text/css"}
    for path, ctype in types.items():
        st, h, body = get(gw, path)
        assert st == 200 and body, (path, st)
        assert h["content-type"].startswith(ctype), h
        csp = h["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "default-src 'none'" in csp, csp
        assert h["x-content-type-options"] == "nosniff" and h["cache-control"] == "no-cache", h
        st, _, body = get(gw, path, {"If-None-Match": h["etag"]})
        assert st == 304 and body == b"", (path, st)
    st, _, body = get(gw, "/")
    assert b"<script" in body and b"<script>" not in body, "the page must not carry inline scripts"
    assert get(gw, "/", {"Host": "evil.example"})[0] == 403, "the Host check must apply to the page too"
    assert get(gw, "/app.js", {"Origin": "http://evil.example"})[0] == 403, "and the Origin check"
    assert get(gw, "/", method="POST")[0] == 405
    assert get(gw, "/v1/swarm")[0] == 401, "the data still needs the key"
    assert get(gw, "/index.html")[0] == 404


def rows(driver):
    """The members table: {address: state}, read in one script (the page replaces its rows each poll)."""
    return driver.execute_script("""return Object.fromEntries(Array.from(
        document.querySelectorAll('#members tbody tr'), (r) => [r.dataset.address, r.dataset.state]));""")


def count(driver, selector):
    return driver.execute_script("return document.querySelectorAll(arguments[0]).length;", selector)


def enter_key(driver, url):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait
    driver.get(url + "/")
    field = WebDriverWait(driver, 10).until(EC.visibility_of_element_located((By.ID, "key")))
    field.send_keys(KEY)
    driver.find_element(By.CSS_SELECTOR, "#key-form button").click()


def chat_streams(driver):
    """Sends a prompt and records the answer's length at every DOM change until it completes."""
    from selenium.webdriver.common.by import By
    driver.execute_script("""
        window.answerLengths = [];
        const a = document.getElementById('answer');
        new MutationObserver(() => window.answerLengths.push(a.textContent.length))
            .observe(a, {characterData: true, childList: true, subtree: true});""")
    driver.find_element(By.ID, "prompt").send_keys("Name three colors of the rainbow.")
    mt = driver.find_element(By.ID, "max-tokens")
    mt.clear()
    mt.send_keys("48")
    driver.find_element(By.ID, "send").click()
    answer = driver.find_element(By.ID, "answer")
    wait_for(lambda: answer.get_attribute("data-state") in ("done", "error"), "the chat answer", timeout=40)
    status = driver.find_element(By.ID, "chat-status").text
    assert answer.get_attribute("data-state") == "done", status
    lengths = [n for n in driver.execute_script("return window.answerLengths;") if n > 0]
    assert len(set(lengths)) >= 3 and lengths == sorted(lengths), f"the answer did not grow as it streamed: {lengths}"
    assert answer.text.strip() and int(answer.get_attribute("data-chunks")) >= 3, status


def test_swarm_page():
    chromium, driver_path = browser_paths()
    tmp = tempfile.mkdtemp(prefix="swarm-page-")
    port_file = os.path.join(tmp, "swarm-port")
    extra_shard, driver = None, None
    t0 = time.time()
    with swarm_cluster(SPANS, KEY, "--swarm-listen", "127.0.0.1:0", "--swarm-port-file", port_file) as cl:
        try:
            gw, shards = cl["gw"], cl["shards"]
            check_static_files(gw)
            driver = start_browser(chromium, driver_path)
            enter_key(driver, gw.url)
            want = {s.address for s in shards.values()}
            wait_for(lambda: rows(driver) == {a: "active" for a in want}, "the three members as active", 15)
            from selenium.webdriver.common.by import By
            assert count(driver, "#chain rect.bar") == 3
            planned = driver.execute_script("return document.getElementById('fig-planned').textContent;")
            assert planned != "-" and float(planned) > 0, planned
            assert not driver.find_element(By.ID, "key-form").is_displayed()
            assert driver.execute_script("return sessionStorage.getItem('fusion.apiKey');") == KEY
            assert KEY not in driver.current_url

            chat_streams(driver)
            with contextlib.suppress(AssertionError):  # a poll whose counters include the chat's tokens
                wait_for(lambda: driver.execute_script("return document.getElementById('fig-gen').textContent;")
                         not in ("-", "0.0"), "tokens/s", 3)
            shot = os.environ.get("FUSION_PAGE_SCREENSHOT") or os.path.join(tmp, "swarm-page.png")
            driver.save_screenshot(shot)
            assert os.path.getsize(shot) > 10000

            join = f"127.0.0.1:{int(open(port_file).read())}"
            extra_shard = Shard(cl["model"], 0, 10, extra=["--join", join])
            wait_for(lambda: rows(driver).get(extra_shard.address) == "active", "the 4th shard on the page", 20)
            assert count(driver, "#chain rect.bar") == 4

            shards["a"].stop(signal.SIGKILL)
            wait_for(lambda: rows(driver).get(shards["a"].address) in ("gone", "unreachable"),
                     "the killed shard turning gone", 15)
        finally:
            if driver:
                driver.quit()
            if extra_shard:
                extra_shard.stop(signal.SIGKILL)
            shutil.rmtree(tmp, ignore_errors=True)
    assert time.time() - t0 < 90


def keyless_gateway(model, hops, directory):
    """A fusion-gateway on loopback without an API key over the static chain `hops`: (process, URL)."""
    port_file = os.path.join(directory, "port")
    cmd = [program("gateway"), "--model", model, "--listen", "127.0.0.1:0", "--port-file", port_file,
           "--secret", SECRET, "--insecure"] + [f for h in hops for f in ("--hop", h)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: os.path.exists(port_file) or proc.poll() is not None, "the gateway's port file", 30)
    assert proc.poll() is None, "fusion-gateway exited"
    return proc, f"http://127.0.0.1:{int(open(port_file).read())}"


def test_static_chain_without_key():
    chromium, driver_path = browser_paths()
    from selenium.webdriver.common.by import By
    model = default_model()
    tmp = tempfile.mkdtemp(prefix="swarm-page-static-")
    shards, proc, driver = [], None, None
    try:
        shards = [Shard(model, 0, 15), Shard(model, 15, 30)]
        proc, url = keyless_gateway(model, [s.hop() for s in shards], tmp)
        driver = start_browser(chromium, driver_path)
        driver.get(url + "/")
        wait_for(lambda: rows(driver) == {s.address: "serving" for s in shards}, "the two hops as serving", 15)
        assert not driver.find_element(By.ID, "key-form").is_displayed(), "no key is asked without keys"
        assert count(driver, "#chain rect.bar") == 2
        assert count(driver, "#chain path.hop") == 3  # gateway, a, b, gateway
    finally:
        if driver:
            driver.quit()
        if proc:
            assert stop_process(proc) == 0
        for s in shards:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
