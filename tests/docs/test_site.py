"""The documentation site (docs/, mkdocs.yml) builds in strict mode, a broken link or anchor
fails that build, the command-line reference lists every option the commands have, and the
README's links lead somewhere."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).with_name("mkdocs")


def load_hook():
    spec = importlib.util.spec_from_file_location(
        "cli_reference", ROOT / "docs" / "hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    if not MKDOCS.exists():
        pytest.skip("mkdocs is not installed (./scripts/setup installs the test extra)")
    return subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(site)],
                          cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def copy_site_sources(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    return root


@pytest.mark.slow
def test_the_site_builds_in_strict_mode(tmp_path):
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "--max-num-seqs" in page and "ZEROSERVE_MAX_NUM_SEQS" in page
    # Help text shows as written: --reasoning-parser's "<think>" is text, not an HTML tag.
    assert "&lt;think&gt;" in page and "<think>" not in page


@pytest.mark.slow
@pytest.mark.parametrize("link", ["[gone](no-such-page.md)",
                                  "[gone](performance.md#no-such-section)"])
def test_a_broken_link_or_anchor_fails_the_build(tmp_path, link):
    root = copy_site_sources(tmp_path)
    page = root / "docs" / "getting-started.md"
    page.write_text(page.read_text() + f"\nSee {link}.\n")
    result = build(root, tmp_path / "site")
    assert result.returncode != 0
    assert "getting-started.md" in result.stderr and link.split("(")[1].rstrip(")") in result.stderr


def commands(group: click.Group, ctx: click.Context, path: str):
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        sub = click.Context(command, info_name=name, parent=ctx)
        yield f"{path} {name}", command
        if isinstance(command, click.Group):
            yield from commands(command, sub, f"{path} {name}")


def test_the_reference_has_every_command_option_and_variable():
    from zeroserve.cli.main import main

    hook = load_hook()
    text = hook.render()
    sections = dict(re.findall(r"^## (zeroserve[^\n]*)\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    envvars = hook.render_envvars()
    seen = 0
    for path, command in commands(main, click.Context(main, info_name="zeroserve"),
                                  "zeroserve"):
        assert path in sections, path
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            for opt in [*param.opts, *param.secondary_opts]:
                assert f"`{opt}`" in sections[path], (path, opt)
            for name in [param.envvar] if isinstance(param.envvar, str) else param.envvar or []:
                assert f"`{name}`" in sections[path] and f"`{name}`" in envvars, (path, name)
            seen += 1
    assert seen > 200  # serve, gateway and worker alone have well over 150


def test_the_markers_are_replaced_by_the_hook():
    hook = load_hook()
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert hook.MARKER in page
    out = hook.on_page_markdown(page, None, None, None)
    assert hook.MARKER not in out and "## zeroserve serve" in out


def test_the_readme_is_short_and_its_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "./scripts/serve" in readme and "./scripts/test" in readme
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links into docs/"
    for target in local:
        assert (ROOT / target).exists(), target
