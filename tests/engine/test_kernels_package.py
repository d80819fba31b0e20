"""Hugging Face's `kernels` package shares the kernels floor's import name: the engine says so plainly."""

import importlib.machinery
import importlib.metadata
import importlib.util
import warnings

import pytest

import engine


def test_this_environment_has_our_kernels_alone():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine._check_kernels_package()


def test_hf_kernels_installed_warns(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: object())
    with pytest.warns(RuntimeWarning, match=r"pip uninstall kernels.*transformers<5\.25"):
        engine._check_kernels_package()


def test_hf_kernels_hiding_ours_is_an_import_error(monkeypatch):
    theirs = importlib.machinery.ModuleSpec("kernels", None, origin="/site-packages/kernels/__init__.py")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: theirs if name == "kernels" else real(name, *a))
    with pytest.raises(ImportError, match=r"finds /site-packages/kernels/__init__\.py, not agentrt's kernels floor"):
        engine._check_kernels_package()
