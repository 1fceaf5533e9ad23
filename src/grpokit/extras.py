"""The install command for an optional package, for grpokit as it is installed here: an extra of the checkout it
was installed from (editable or not), an extra of the index's grpokit, or the package itself when grpokit runs from
a checkout on the path. One place, so that every "needs X" message tells the same truth."""

from __future__ import annotations

import importlib.util
import json
from urllib.parse import unquote, urlparse


def installed_from() -> tuple[str, str | None]:
    """('editable' | 'directory', path) for an install from a folder, ('index', None) for one from a package index,
    ('file', None) for one from a wheel or an archive, ('none', None) when grpokit is not installed (a checkout on
    sys.path)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("grpokit")
    except PackageNotFoundError:
        return "none", None
    direct = dist.read_text("direct_url.json")
    if not direct:
        return "index", None
    info = json.loads(direct)
    url = urlparse(info.get("url", ""))
    if url.scheme == "file" and "dir_info" in info:
        return ("editable" if info["dir_info"].get("editable") else "directory"), unquote(url.path)
    return "file", None


def install_command(extra: str, package: str) -> str:
    """`pip install ...` for grpokit's `extra` (which holds `package`), or for `package` alone when grpokit is not
    installed or was installed from a wheel (whose extras pip cannot add to)."""
    how, path = installed_from()
    if how == "editable":
        return f"pip install -e '{path}[{extra}]'"
    if how == "directory":
        return f"pip install '{path}[{extra}]'"
    if how == "index":
        return f"pip install 'grpokit[{extra}]'"
    return f"pip install {package}"


def is_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def missing_message(what: str, module: str, extra: str, package: str | None = None) -> str | None:
    """'WHAT needs PACKAGE, which is not installed: pip install ...', or None when `module` imports."""
    if is_installed(module):
        return None
    package = package or module
    return f"{what} needs {package}, which is not installed here: {install_command(extra, package)}"
