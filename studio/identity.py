"""Who is calling: the owner whose memories, plug-ins, jobs, comparisons and shares a call may see and act on.

* **Single-user mode** (a studio bound to 127.0.0.1, the CLIs, direct :class:`~studio.service.Studio` use): every
  caller is :data:`LOCAL`, who owns everything made there (and every row of a catalog older than owners).
* **Multi-user mode** (a studio bound to another host, or ``--multi-user``): a caller is, in this order,
  1. the holder of a **key** sent with the request — header ``X-Pema-Key: <key>`` (or ``Authorization: Bearer
     <key>``): what API clients send, e.g. ``gradio_client.Client(url, headers={"X-Pema-Key": key})``;
  2. the **Hugging Face user** signed in with "Sign in with Hugging Face" (a Space with ``hf_oauth: true``);
  3. the **browser**: an anonymous key kept in the HttpOnly cookie ``pema_owner``, set on the first visit.
  A request with none of these has no owner and is refused for anything but public reads (status, methods, shares).

Keys are ``pk1.<kind>.<subject>.<mac>``: ``kind`` ``a`` (anonymous, ``subject`` 192 random bits) or ``hf``
(``subject`` the HF user name), ``mac`` an HMAC-SHA256 of kind and subject under the studio's secret (``$PEMA_SECRET``,
else ``<data dir>/owner-secret``, made on first use, mode 0600). A key is therefore only valid if this studio made it,
and can always be shown again to its holder (the page shows it, for API use). The owner stored in the catalog is
``anon:<sha256 of the subject>`` or ``hf:<user name>``, never the key itself. Changing the secret makes every key
invalid (their owners' things stay in the catalog but nobody can reach them).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ground.errors import UserError
from ground.store import LOCAL_OWNER

LOCAL = LOCAL_OWNER
KEY_HEADER = "x-pema-key"
COOKIE = "pema_owner"
KEY_PREFIX = "pk1"
_SUBJECT = re.compile(r"^[A-Za-z0-9_\-.]{1,96}$")

NO_KEY = ("This studio is shared by several people and this request does not say whose things it is about: open the "
          "page in a browser (it keeps your key in a cookie), or send your key in the X-Pema-Key header (the page "
          "shows it under “Your key”).")


@dataclass(frozen=True)
class Caller:
    """The identity of one request. ``owner`` is ``None`` when the request carries none (multi-user mode)."""

    owner: str | None
    key: str = ""  # what the caller sends to be this owner again (shown on the page; empty for LOCAL)
    how: str = "local"  # local | key | hf | browser | none
    name: str = ""  # the HF user name, when signed in

    def describe(self) -> str:
        return {"local": "single-user mode: everything here is yours",
                "key": "identified by the key sent with the request",
                "hf": f"signed in as {self.name} (Hugging Face)",
                "browser": "anonymous: identified by a key kept in this browser",
                "none": "no identity"}.get(self.how, self.how)


class Identity:
    """Makes and checks keys, and resolves a request's headers/cookies/HF session to a :class:`Caller`."""

    def __init__(self, root: str | os.PathLike, multi_user: bool = False, secret: bytes | str | None = None):
        self.root = Path(root)
        self.multi_user = bool(multi_user)
        self._secret = secret.encode() if isinstance(secret, str) else secret

    # --- the secret ---------------------------------------------------------------------------------------------
    @property
    def secret(self) -> bytes:
        if self._secret is None:
            env = os.environ.get("PEMA_SECRET")
            self._secret = env.encode() if env else self._file_secret()
        return self._secret

    def _file_secret(self) -> bytes:
        path = self.root / "owner-secret"
        if not path.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".owner-secret.{secrets.token_hex(4)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            try:
                os.link(tmp, path)  # first writer wins; a concurrent start reads the same secret
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        return path.read_text().strip().encode()

    # --- keys ---------------------------------------------------------------------------------------------------
    def _mac(self, kind: str, subject: str) -> str:
        d = hmac.new(self.secret, f"{kind}:{subject}".encode(), hashlib.sha256).digest()[:24]
        return base64.urlsafe_b64encode(d).decode().rstrip("=")

    def key_for(self, kind: str, subject: str) -> str:
        return f"{KEY_PREFIX}.{kind}.{subject}.{self._mac(kind, subject)}"

    def new_browser_key(self) -> str:
        """A fresh anonymous key (192 random bits, signed)."""
        return self.key_for("a", secrets.token_urlsafe(24).replace(".", "_"))

    def parse(self, key: str | None) -> tuple[str, str] | None:
        """``(kind, subject)`` of a key this studio made, else ``None``."""
        if not key or not isinstance(key, str) or len(key) > 200:
            return None
        parts = key.strip().split(".")
        if len(parts) < 4 or parts[0] != KEY_PREFIX or parts[1] not in ("a", "hf"):
            return None
        kind, subject, mac = parts[1], ".".join(parts[2:-1]), parts[-1]
        if not _SUBJECT.match(subject) or not hmac.compare_digest(mac, self._mac(kind, subject)):
            return None
        return kind, subject

    def owner_of_key(self, key: str | None) -> str | None:
        parsed = self.parse(key)
        if parsed is None:
            return None
        kind, subject = parsed
        return f"hf:{subject}" if kind == "hf" else "anon:" + hashlib.sha256(subject.encode()).hexdigest()[:32]

    # --- requests -----------------------------------------------------------------------------------------------
    def credentials(self, headers: Mapping[str, str] | None = None,
                    cookies: Mapping[str, str] | None = None) -> frozenset[str]:
        """The owners a request can prove to be by what it carries itself — a valid key header and a valid
        browser cookie (a signed-in HF user's browser carries its cookie too) — for binding an upload to the
        requests that may use it (``studio.uploads``). Single-user mode: the local user. Invalid keys count as
        nothing."""
        if not self.multi_user:
            return frozenset({LOCAL})
        h = {str(k).lower(): v for k, v in (headers or {}).items()}
        key = (h.get(KEY_HEADER) or "").strip()
        auth = (h.get("authorization") or "").strip()
        if not key and auth.lower().startswith("bearer "):
            key = auth[7:].strip()
        found = {self.owner_of_key(key), self.owner_of_key((cookies or {}).get(COOKIE))}
        return frozenset(o for o in found if o)

    def resolve(self, headers: Mapping[str, str] | None = None, cookies: Mapping[str, str] | None = None,
                hf_user: str | None = None) -> Caller:
        """The caller of a request (header names in any case). A key header that this studio did not make is an
        error (it never falls back to another identity silently)."""
        if not self.multi_user:
            return Caller(LOCAL)
        h = {str(k).lower(): v for k, v in (headers or {}).items()}
        key = (h.get(KEY_HEADER) or "").strip()
        if not key:
            auth = (h.get("authorization") or "").strip()
            if auth.lower().startswith("bearer ") and auth[7:].strip().startswith(KEY_PREFIX + "."):
                key = auth[7:].strip()  # other bearer tokens (e.g. a private Space's HF token) are not ours
        if key:
            owner = self.owner_of_key(key)
            if owner is None:
                raise UserError("The key sent with this request is not valid for this studio (copy it again from "
                                "the page, under “Your key”).")
            return Caller(owner, key, "key", owner[3:] if owner.startswith("hf:") else "")
        if hf_user and _SUBJECT.match(hf_user):
            return Caller(f"hf:{hf_user}", self.key_for("hf", hf_user), "hf", hf_user)
        cookie = (cookies or {}).get(COOKIE)
        owner = self.owner_of_key(cookie)
        if owner is not None:
            return Caller(owner, cookie, "browser")
        return Caller(None, "", "none")
