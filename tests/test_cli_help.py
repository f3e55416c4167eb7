"""Every command-line entry point answers ``--help`` without running anything."""
import sys

import pytest


@pytest.mark.parametrize("name", ["", "all", "rows", "train", "build", "decode", "precision", "knn1m"])
def test_core_benchmarks_print_help_without_importing_the_benchmarks(name, capsys, monkeypatch):
    from benchmarks import __main__ as entry

    monkeypatch.delitem(sys.modules, "benchmarks.core", raising=False)
    argv = [name, "--help"] if name else ["--help"]
    assert entry.main(argv) == 0
    assert "python -m benchmarks" in capsys.readouterr().out
    assert "benchmarks.core" not in sys.modules  # nothing was loaded, trained or measured


@pytest.mark.parametrize("module", ["eval.__main__", "memories.__main__", "plugins.__main__", "offsite.__main__",
                                    "plugins.estimate"])
def test_package_clis_answer_help_for_every_subcommand(module, capsys):
    import importlib
    import re

    mod = importlib.import_module(module)
    with pytest.raises(SystemExit) as top:
        mod.main(["--help"])
    assert top.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage:")
    subcommands = re.search(r"\{([a-z_,-]+)\}", text).group(1).split(",")
    assert len(subcommands) >= 1
    for name in subcommands:
        with pytest.raises(SystemExit) as sub:
            mod.main([name, "--help"])
        assert sub.value.code == 0, name
        assert capsys.readouterr().out.startswith("usage:"), name
