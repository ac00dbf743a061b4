"""transformers' import-time scans answered from megarl's cache (`megarl.utils.import_cache`): the same lazy
module as without it, recomputed when a file under the scanned directory or the installed set changes, and a
broken or unwritable cache only costs the scan."""

import json
import os
import subprocess
import sys

import pytest

from megarl.utils import import_cache

DIR_OF_TRANSFORMERS = (
    "import json, sys, megarl, transformers, transformers.models.auto.configuration_auto as auto;"
    "from transformers.utils import import_utils as iu;"
    "print(json.dumps({'names': sorted(dir(transformers)), 'models': sorted(dir(transformers.models)),"
    " 'configs': sorted(auto.CONFIG_MAPPING_NAMES), 'cached': hasattr(iu.define_import_structure, 'megarl_cached'),"
    " 'dists': {k: sorted(v) for k, v in iu.PACKAGE_DISTRIBUTION_MAPPING.items()}}))"
)


def _transformers_in_a_fresh_process(cache_dir, enabled: bool) -> dict:
    env = {**os.environ, "MEGARL_CACHE_DIR": str(cache_dir), "MEGARL_IMPORT_CACHE": "1" if enabled else "0"}
    run = subprocess.run(
        [sys.executable, "-c", DIR_OF_TRANSFORMERS], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_transformers_imports_the_same_from_a_cold_and_a_warm_cache_as_without_one(tmp_path):
    plain = _transformers_in_a_fresh_process(tmp_path, enabled=False)
    assert not plain["cached"] and not (tmp_path / "imports").exists()
    cold = _transformers_in_a_fresh_process(tmp_path, enabled=True)
    written = sorted(p.name for p in (tmp_path / "imports").iterdir())
    assert cold["cached"] and len(written) >= 2  # the models directory's structure and the distributions at least
    warm = _transformers_in_a_fresh_process(tmp_path, enabled=True)
    assert sorted(p.name for p in (tmp_path / "imports").iterdir()) == written  # read, not written again
    for key in ("names", "models", "configs", "dists"):
        assert cold[key] == plain[key] and warm[key] == plain[key], key
    assert "Qwen2Config" in warm["names"] and "qwen2" in warm["configs"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path / "cache"))
    import_cache.tree_fingerprint.cache_clear()
    yield tmp_path / "cache" / "imports"
    import_cache.tree_fingerprint.cache_clear()


def _scan_counting(calls: list):
    """A stand-in for transformers' scan: the files of the directory and their contents."""

    def define(module_path, prefix=None):
        calls.append(prefix)
        root = str(module_path)
        files = {os.path.join(r, n): open(os.path.join(r, n)).read() for r, _, names in os.walk(root) for n in names}
        return {prefix: files}

    return define


def test_a_scan_is_recomputed_when_a_file_under_its_directory_changes(tmp_path, cache):
    package = tmp_path / "models"
    (package / "llama").mkdir(parents=True)
    (package / "llama" / "modeling.py").write_text("__all__ = ['A']\n")
    calls = []
    define = import_cache.cached_import_structure(_scan_counting(calls))
    first = define(str(package), "models")
    assert define(str(package), "models") == first and calls == ["models"]  # the second from the cache
    assert define(package / "__init__.py", "models") == first and calls == ["models"]  # a file: its directory
    (package / "llama" / "modeling.py").write_text("__all__ = ['A', 'B']\n")  # size changes
    import_cache.tree_fingerprint.cache_clear()  # a new process
    define(str(package), "models")
    assert calls == ["models", "models"]
    (package / "qwen").mkdir()  # a new model directory
    import_cache.tree_fingerprint.cache_clear()
    define(str(package), "models")
    assert calls == ["models", "models", "models"]
    define(str(package), None)  # another prefix, another entry
    assert calls[-1] is None


def test_a_broken_or_unwritable_cache_computes_the_value(tmp_path, cache, monkeypatch):
    calls = []

    def compute():
        calls.append(1)
        return {"value": len(calls)}

    assert import_cache.cached("entry", "key", compute) == {"value": 1}
    (entry,) = cache.iterdir()
    entry.write_bytes(b"\x80\x05truncated")
    assert import_cache.cached("entry", "key", compute) == {"value": 2}  # unreadable: computed and written again
    assert import_cache.cached("entry", "key", compute) == {"value": 2} and len(calls) == 2
    assert import_cache.cached("entry", "other key", compute) == {"value": 3}
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(blocker))  # its `imports` cannot be created
    assert import_cache.cached("entry", "key", compute) == {"value": 4}
    monkeypatch.setenv("MEGARL_CACHE_DIR", str(tmp_path / "other"))
    monkeypatch.setattr(import_cache.pickle, "dump", lambda *a, **k: (_ for _ in ()).throw(TypeError("unpicklable")))
    assert import_cache.cached("entry", "key", compute) == {"value": 5}
    assert not [p for p in (tmp_path / "other" / "imports").iterdir()]  # nothing left half-written


def test_the_distributions_are_recomputed_after_an_install(tmp_path, cache, monkeypatch):
    site = tmp_path / "site"
    (site / "pkg-1.0.dist-info").mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [str(site)])
    calls = []
    mapping = import_cache.cached_packages_distributions(lambda: calls.append(1) or {"pkg": ["pkg"]})
    assert mapping() == mapping() == {"pkg": ["pkg"]} and len(calls) == 1
    os.utime(site, ns=(0, os.stat(site).st_mtime_ns + 10**9))  # what adding or removing a distribution does
    mapping()
    assert len(calls) == 2
