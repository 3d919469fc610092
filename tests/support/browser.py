"""A headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
JSON messages separated by NUL bytes on file descriptors 3 and 4), so a test can load pages,
answer the browser's login prompt, click and read the page, with nothing beyond the standard
library. Scripts a test runs go through DevTools (`Runtime.evaluate`), which the page's
Content-Security-Policy does not govern; the page's own scripts stay forbidden."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from tests.support.waiting import wait_for


class Browser:
    """One Chromium process and one page. `login` is what the browser answers when a server
    asks for basic auth (None: it cancels the prompt)."""

    def __init__(self, chromium: str, profile: Path, login: tuple[str, str] | None) -> None:
        self.login = login
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        args = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        # bash puts the pipes on the descriptors Chromium reads (3) and writes (4) (dash takes
        # single-digit descriptors only).
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}', "bash", *args],
            pass_fds=(to_chrome_r, from_chrome_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next = 0
        self._lock = threading.Lock()
        self._answers: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        self._session = attached["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Fetch.enable", {"handleAuthRequests": True}, session=True)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        os.close(self._to_chrome)

    def _send(self, message: dict[str, Any]) -> int:
        with self._lock:
            self._next += 1
            message["id"] = self._next
            os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
            return self._next

    def call(
        self, method: str, params: dict[str, Any] | None = None, *, session: bool = False
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"method": method, "params": params or {}}
        if session:
            message["sessionId"] = self._session
        number = self._send(message)
        answer: dict[str, Any] = wait_for(lambda: self._answers.pop(number, {}), 30, what=method)
        if "error" in answer:
            raise AssertionError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    def _read(self) -> None:
        buffer = b""
        while True:
            chunk = os.read(self._from_chrome, 65536)
            if not chunk:
                return
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    self._answers[message["id"]] = message
                else:
                    self._on_event(message)

    def _on_event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        session = message.get("sessionId")
        if method == "Fetch.requestPaused":
            self._send(
                {
                    "method": "Fetch.continueRequest",
                    "params": {"requestId": params["requestId"]},
                    "sessionId": session,
                }
            )
        elif method == "Fetch.authRequired":
            if self.login is None:
                answer: dict[str, str] = {"response": "CancelAuth"}
            else:
                user, password = self.login
                answer = {"response": "ProvideCredentials", "username": user, "password": password}
            self._send(
                {
                    "method": "Fetch.continueWithAuth",
                    "params": {"requestId": params["requestId"], "authChallengeResponse": answer},
                    "sessionId": session,
                }
            )
        self.events.append(message)

    def _loads(self) -> int:
        return sum(e.get("method") == "Page.loadEventFired" for e in self.events)

    def goto(self, url: str) -> None:
        """Load `url` and wait for its load event."""
        before = self._loads()
        self.call("Page.navigate", {"url": url}, session=True)
        wait_for(lambda: self._loads() > before, 30, what=f"{url} loaded")

    def evaluate(self, expression: str) -> Any:
        """The value of a script run in the page (awaited when it is a promise)."""
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=True,
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def click_and_wait(self, selector: str) -> None:
        """Click the element and wait for the page it leads to."""
        before = self._loads()
        assert self.evaluate(f"!!document.querySelector({json.dumps(selector)})"), selector
        self.evaluate(f"document.querySelector({json.dumps(selector)}).click()")
        wait_for(lambda: self._loads() > before, 30, what=f"the page after clicking {selector}")

    def text(self) -> str:
        return str(self.evaluate("document.body ? document.body.innerText : ''"))
