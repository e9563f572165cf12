"""transformers beside this repository's top-level kernels/ directory.

transformers >= 5.25 depends on Hugging Face's `kernels` package and, when its metadata
says that package is installed, imports `kernels` while loading models. Wherever the
repository root is on sys.path (pytest's rootdir for the tests/ package, `python -m
bench.x` from the root, a legacy editable install), `import kernels` finds this
repository's kernels/ (shipped as specdraft.kernels) instead, and transformers fails
with an ImportError (seen on a fresh CI clone with transformers 5.25.0 and kernels
0.19.1, 2026-12-03). specdraft never imports transformers; its tests and benchmarks use
it as a reference and a peer, and none of them needs the hub kernels."""

from __future__ import annotations


def hide_repo_kernels_from_transformers() -> None:
    """Turn transformers' hub kernels off (USE_HUB_KERNELS=NO, unless set) and make its
    probe for the `kernels` package answer "not installed", so it never imports the name
    this checkout shadows. A no-op without transformers."""
    import os

    os.environ.setdefault("USE_HUB_KERNELS", "NO")
    try:
        import transformers.utils.import_utils as iu
    except ImportError:
        return
    probe = getattr(iu, "_is_package_available", None)
    if probe is None or getattr(probe, "_specdraft_shim", False):
        return

    def package_available(pkg_name: str, return_version: bool = False):
        if pkg_name == "kernels":
            return (False, "N/A") if return_version else (False, None)
        return probe(pkg_name, return_version)

    package_available._specdraft_shim = True
    iu._is_package_available = package_available
    cached = getattr(iu, "is_kernels_available", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
