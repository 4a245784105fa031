"""Shared test setup.

Unit tests import the overlay from this checkout, not the copy that apply.sh
installed into the environment's vLLM: the repo's `vllm_overlay/vllm/...` folders
are put first on the matching package `__path__`s. End-to-end tests start engine
processes that import the installed copy; scripts/test.sh re-applies the series
whenever patches/ or vllm_overlay/ change, and `installed_overlay_matches` fails
loudly when the two disagree.
"""

import hashlib
import importlib.util
import os
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
OVERLAY = REPO / "vllm_overlay" / "vllm"
# A plug-in policy package, installed the way pip lays one out (a dist-info with
# its entry point): on sys.path before vLLM loads, so that every policy test
# covers it too (tests/plugin_site/vtoken_oldest).
PLUGIN_SITE = REPO / "tests" / "plugin_site"
sys.path.insert(0, str(PLUGIN_SITE))


def load_script(name: str):
    """scripts/NAME.py as a module. scripts/ is not a package, and its
    scripts import each other from their folder: that folder goes on
    sys.path."""
    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(name, REPO / f"scripts/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prefer_repo_overlay() -> None:
    import vllm

    for pkg_dir in sorted(p for p in OVERLAY.rglob("*") if p.is_dir()):
        if pkg_dir.name == "__pycache__":
            continue
        rel = pkg_dir.relative_to(OVERLAY)
        installed = pathlib.Path(vllm.__path__[-1]) / rel
        if installed.is_dir() and (installed / "__init__.py").exists():
            import importlib

            mod = importlib.import_module("vllm." + ".".join(rel.parts))
            if str(pkg_dir) not in mod.__path__:
                mod.__path__.insert(0, str(pkg_dir))
    if str(OVERLAY) not in vllm.__path__:
        vllm.__path__.insert(0, str(OVERLAY))


_prefer_repo_overlay()


def installed_overlay_matches() -> bool:
    """True when the environment's vLLM carries this checkout's overlay files."""
    import vllm

    site = pathlib.Path(vllm.__path__[-1])
    for f in OVERLAY.rglob("*.py"):
        inst = site / f.relative_to(OVERLAY)
        if not inst.exists() or (
            hashlib.sha256(inst.read_bytes()).digest()
            != hashlib.sha256(f.read_bytes()).digest()
        ):
            return False
    return True


def pytest_collection_modifyitems(config, items):
    has_gpu = False
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        pass
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none present)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def repo() -> pathlib.Path:
    return REPO


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
