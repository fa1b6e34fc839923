"""A real headless Chromium for the tests that drive the UIs (tests/e2e/test_ui.py, test_stack.py), and the few
things they do with a page: find and click, wait for a condition, fill a Prefect schema-form field.

Needs Debian's `chromium` and `chromium-driver` and `selenium` (the dev extra); `make test` installs them where it
may (root with apt-get, as in CI). `browser_missing()` says what is missing, or None.
"""

from __future__ import annotations

import base64
import shutil
import time
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
except ImportError:
    webdriver = None


def browser_missing() -> str | None:
    """What the browser tests lack to run here, in one line; None when nothing is missing."""
    missing = [what for what, found in (("Chromium and its driver: apt-get install -y chromium chromium-driver",
                                         CHROMIUM and CHROMEDRIVER),
                                        ("selenium: pip install -e '.[dev]'", webdriver)) if not found]
    return "needs " + "; ".join(missing) if missing else None


def start_browser(profile: Path):
    """Headless Chromium with a profile of its own (runs side by side never share one)."""
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # as root (CI) Chromium starts only without its sandbox; nothing that reaches for the internet (updates, sync,
    # QUIC), which a CI machine may not have
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    return driver


def send_basic_auth(driver, user: str, password: str) -> None:
    """Every request the browser makes from now on carries this HTTP basic login (as a browser does once a person
    typed it into its login prompt, which a headless browser cannot show)."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}})


def field(driver, label: str):
    """The input of the schema-form property whose label reads '<label> (Optional)' (a header, then a body)."""
    from selenium.webdriver.common.by import By

    header = (f"./div[@class='p-label__header']//span[@class='schema-form-property__label' and "
              f"starts-with(normalize-space(), '{label} (')]")
    [element] = driver.find_elements(By.XPATH, f"//div[contains(@class, 'schema-form-property')][{header}]"
                                               f"/div[@class='p-label__body']/fieldset//input")
    return element


def type_into(driver, label: str, value: str, timeout: float = 30) -> None:
    """Replace the text of the field labelled `label` with `value` and wait until the field holds it. The form's
    component re-renders as it validates: a key can land in the node it is replacing and be lost ('64' read back as
    '6', once in a suite on 2 cores), so the field is found and typed into again until it reads `value`."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.keys import Keys

    def typed() -> bool:
        try:
            element = field(driver, label)
            if element.get_attribute("value") != value:
                driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
                element.send_keys(Keys.CONTROL, "a")
                element.send_keys(value)
            return wait_settled(lambda: field(driver, label).get_attribute("value") == value)
        except (StaleElementReferenceException, ValueError):  # replaced, or not one field, mid re-render
            return False

    wait_for(f"the field {label!r} to hold {value!r}", typed, timeout, driver)


def wait_settled(condition, seconds: float = 0.5) -> bool:
    """`condition` still true after `seconds` (a field that reads right now and is re-rendered a moment later is not
    done)."""
    import time

    if not condition():
        return False
    time.sleep(seconds)
    return bool(condition())


def click(driver, xpath: str) -> bool:
    """Click the first element `xpath` finds; False if there is none yet or it was re-rendered under us."""
    from selenium.common.exceptions import ElementClickInterceptedException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        found = driver.find_elements(By.XPATH, xpath)
        if found:
            try:
                found[0].click()
            except ElementClickInterceptedException:  # another toast sliding over it: click it the DOM's way
                driver.execute_script("arguments[0].click()", found[0])
        return bool(found)
    except StaleElementReferenceException:  # Vue replaced the node between find and click: find it again
        return False


def page_text(driver) -> str:
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        return driver.find_element("tag name", "body").text
    except StaleElementReferenceException:
        return ""


def wait_for(what: str, condition, timeout: float, driver=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(1)
    hint = f"; the page ({driver.current_url}) said: {page_text(driver)[-2500:]}" if driver else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{hint}")


def console(driver) -> list[str]:
    """The browser console's last messages (Chromium keeps its errors and warnings)."""
    try:
        return [entry.get("message", "")[:300] for entry in driver.get_log("browser")][-10:]
    except Exception as e:  # a driver that keeps no log
        return [f"no console log: {e}"]
