"""The credentials of the stack `r1 up` starts: made once, kept under R1_HOME, used by every `r1` command.

    <R1_HOME>/auth/                 mode 0700
        credentials.env             mode 0600: PREFECT_API_AUTH_STRING, MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD
        mlflow-auth.ini             MLflow's basic-auth settings (no secret in it)
        mlflow-auth.db              MLflow's user store: the admin user `r1 up` made, and any a team adds

The Prefect server checks `PREFECT_SERVER_API_AUTH_STRING` (`user:password`, HTTP basic auth) on every API call but
its health check; clients and workers send `PREFECT_API_AUTH_STRING`, and the UI asks for it once a browser.
The MLflow server runs its `basic-auth` app: users with per-experiment permissions in its own store, the admin user
made on its first start from MLFLOW_AUTH_ADMIN_PASSWORD; clients send `MLFLOW_TRACKING_USERNAME` and
`MLFLOW_TRACKING_PASSWORD`, the UI asks for them. Each secret is 32 random bytes (`secrets.token_urlsafe`).

`credentials.env` is a shell file (`set -a; . credentials.env; set +a` gives a shell the three variables). An `r1`
command pointed at the stack (PREFECT_API_URL or MLFLOW_TRACKING_URI set to its addresses, as `r1 up` says to)
takes the variables it lacks from it, so nothing needs exporting but the addresses; a variable already set is kept
(a wrong one is told by the preflight, before any stage). Nothing here prints a secret: only where it is kept.

Must not import Prefect or MLflow (it runs before either is configured).
"""

from __future__ import annotations

import os
import secrets
import shlex
from pathlib import Path

PREFECT_USER = "r1"
MLFLOW_USER = "r1-admin"
CLIENT_VARS = ("PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
# what any MLflow user may do on an experiment nobody granted them: read it. Users come from the admin
# (`POST /api/2.0/mlflow/users/create`); anyone without a login gets nothing at all
DEFAULT_PERMISSION = "READ"
# how long the MLflow server trusts a login it has checked (its `auth_cache_ttl_seconds`, 0 = off by MLflow's default):
# each check is a scrypt hash, ~0.1 s of CPU, and a training run or a UI page sends a request every few hundred ms.
# `r1 up` runs one worker, so a password changed through the API is seen at once; one changed in the store's file
# directly, within this many seconds
AUTH_CACHE_TTL_S = 60


def _home() -> Path:  # runtime.tracking.r1_home, without importing MLflow
    from runtime.env import home_path

    return home_path()


def auth_dir() -> Path:
    return _home() / "auth"


def credentials_path() -> Path:
    return auth_dir() / "credentials.env"


def user_store() -> Path:
    return auth_dir() / "mlflow-auth.db"


def read_credentials(path: Path | None = None) -> dict[str, str] | None:
    """The stack's credentials (the three CLIENT_VARS), or None where none were made."""
    path = path or credentials_path()
    if not path.exists():
        return None
    values = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() in CLIENT_VARS:
            values[name.strip()] = shlex.split(value)[0] if value.strip() else ""
    missing = [name for name in CLIENT_VARS if not values.get(name)]
    if missing:
        raise RuntimeError(f"{path} lacks {', '.join(missing)}: restore the file, or delete it and "
                           f"{user_store()} to make new credentials (the users a team added to MLflow go with it)")
    return values


def ensure_credentials() -> dict[str, str]:
    """The stack's credentials, made the first time: the folder 0700, the file 0600, written whole or not at all."""
    made = read_credentials()
    if made is not None:
        return made
    if user_store().exists():  # its admin holds a password nobody has any more
        raise RuntimeError(f"{credentials_path()} is gone but MLflow's user store {user_store()} remains, and its "
                           "admin's password went with the file: restore the file, or delete the store to make new "
                           "credentials (the users a team added to MLflow go with it)")
    folder = auth_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    values = {"PREFECT_API_AUTH_STRING": f"{PREFECT_USER}:{secrets.token_urlsafe(32)}",
              "MLFLOW_TRACKING_USERNAME": MLFLOW_USER, "MLFLOW_TRACKING_PASSWORD": secrets.token_urlsafe(32)}
    text = ("# the credentials of the stack `r1 up` starts; `set -a; . this-file; set +a` exports them\n"
            + "".join(f"{name}={shlex.quote(values[name])}\n" for name in CLIENT_VARS))
    partial = folder / ".credentials.env.partial"
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, credentials_path())
    return values


def prefect_server_env(values: dict[str, str]) -> dict[str, str]:
    """The Prefect server's environment: the credential it checks, and the one its own services send back to it."""
    return {"PREFECT_SERVER_API_AUTH_STRING": values["PREFECT_API_AUTH_STRING"],
            "PREFECT_API_AUTH_STRING": values["PREFECT_API_AUTH_STRING"]}


# Prefect's UI asks for the login only on its root page: a deep link (a run's page, a deployment's) opened without
# one shows "Oops. Something went wrong." over an empty page (its calls answered 401). This runs first in the UI's
# page of a server that asks for a login: without the login the UI keeps (`prefect-password`, as its login form
# stores it), it goes to that form, which opens the deep link once the login is taken.
_LOGIN_FIRST = ("<script>/* r1: a deep link without a login goes to the login form */(function(){try{"
                "var p=location.pathname;if(localStorage.getItem('prefect-password')||/\\/login\\/?$/.test(p))return;"
                "location.replace('/login?redirect='+encodeURIComponent(p+location.search+location.hash));"
                "}catch(e){}})();</script>")


def prefect_ui_login_first(static_root: Path) -> None:
    """Put _LOGIN_FIRST at the head of the UI pages a Prefect server with a login serves from `static_root` (its
    PREFECT_UI_STATIC_DIRECTORY, which it fills as it starts); a page that has it already is left as it is."""
    for page in static_root.glob("v1/index.html"):
        html = page.read_text()
        if _LOGIN_FIRST not in html:
            page.write_text(html.replace("<head>", "<head>" + _LOGIN_FIRST, 1))


def mlflow_server_env(values: dict[str, str]) -> dict[str, str]:
    """The MLflow basic-auth app's environment, its settings file written beside the user store."""
    ini = auth_dir() / "mlflow-auth.ini"
    ini.write_text("[mlflow]\n"
                   f"default_permission = {DEFAULT_PERMISSION}\n"
                   f"database_uri = sqlite:///{user_store()}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                   f"auth_cache_ttl_seconds = {AUTH_CACHE_TTL_S}\n")
    return {"MLFLOW_AUTH_CONFIG_PATH": str(ini),
            "MLFLOW_AUTH_ADMIN_USERNAME": values["MLFLOW_TRACKING_USERNAME"],
            "MLFLOW_AUTH_ADMIN_PASSWORD": values["MLFLOW_TRACKING_PASSWORD"],
            # signs the UI's CSRF tokens; a new one each start only logs browsers out of forms in flight
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_urlsafe(32)}


def _same_address(a: str, b: str) -> bool:
    def norm(url: str) -> str:
        return url.strip().rstrip("/").replace("://localhost:", "://127.0.0.1:")

    return bool(a) and norm(a) == norm(b)


def use_stack_credentials(environ=os.environ) -> str | None:
    """Give this process the credentials of the stack its environment points at, where it lacks them. Returns a
    one-line warning where that stack was started without authentication (an older `r1 up`), else None."""
    import json

    state_file = _home() / "stack" / "stack.json"  # flows.cli.stack.state_path
    state = json.loads(state_file.read_text()) if state_file.exists() else None
    if not state:
        return None
    prefect = _same_address(environ.get("PREFECT_API_URL", ""), state.get("prefect_api", ""))
    mlflow = _same_address(environ.get("MLFLOW_TRACKING_URI", ""), state.get("mlflow_ui", ""))
    if not (prefect or mlflow):
        return None
    if not state.get("auth"):
        return (f"the stack at {state.get('prefect_ui')} and {state.get('mlflow_ui')} was started without "
                "authentication by an older `r1 up`, so anyone who reaches its ports can use it: `r1 down`, then "
                "`r1 up` starts it again with credentials (runs, artifacts and deployments are kept)")
    try:
        values = read_credentials(Path(state["auth"]))
    except RuntimeError as e:
        return str(e)
    if values is None:
        return (f"the stack's credentials file {state['auth']} is gone: `r1 down`, then `r1 up` (or set "
                f"{', '.join(CLIENT_VARS)} yourself)")
    wanted = (["PREFECT_API_AUTH_STRING"] if prefect else []) + \
        (["MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"] if mlflow else [])
    if mlflow and (environ.get("MLFLOW_TRACKING_USERNAME") or environ.get("MLFLOW_TRACKING_TOKEN")):
        wanted = [name for name in wanted if not name.startswith("MLFLOW_")]  # a login of the user's own: theirs
    for name in wanted:
        environ.setdefault(name, values[name])
    return None
