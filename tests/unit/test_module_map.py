"""Every module says which one job it does, and docs/modules.md (the module map) says the same."""

import pytest

from tests.module_map import ROOT, job, modules, render


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_names_its_job_in_its_first_docstring_line(path):
    assert job(path), f"{path.relative_to(ROOT)} has no docstring naming its job"


def test_the_module_map_matches_the_code():
    assert (ROOT / "docs" / "modules.md").read_text() == render(), (
        "docs/modules.md is stale: regenerate it with `.venv/bin/python -m tests.module_map > docs/modules.md`"
    )


def test_the_readme_links_the_module_map():
    assert "(docs/modules.md)" in (ROOT / "README.md").read_text()
