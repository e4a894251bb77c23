"""The command-line reference, generated from the click commands themselves.

An mkdocs hook (mkdocs.yml, `hooks:`): a page holding MARKER gets, in its place, every
`zeroserve` command with each of its options: the flag, the environment variable it also
reads, its default and its help; a page holding ENV_MARKER gets every such variable. It walks `zeroserve.cli.main:main` (the entry point)
through click's own objects, never `--help` text, so the reference cannot drift from the
code. `render()` is importable on its own (tests/docs use it).
"""

from __future__ import annotations

import inspect

import click

MARKER = "<!-- cli-reference -->"
ENV_MARKER = "<!-- cli-envvars -->"


def _text(text: str) -> str:
    """Help text as markdown shows it: no HTML tags (`<think>`), no stray emphasis."""
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


def _cell(text: str) -> str:
    return _text(" ".join(text.split())).replace("|", "\\|")


def _default(param: click.Option) -> str:
    if param.show_default is False or param.default is None or callable(param.default):
        return ""
    if isinstance(param.show_default, str):
        return _cell(param.show_default)
    if param.is_flag and not param.count:
        if param.secondary_opts:  # --x/--no-x
            return param.opts[0] if param.default else param.secondary_opts[0]
        return "on" if param.default else "off"
    if isinstance(param.default, (list, tuple)):
        return _cell(", ".join(str(v) for v in param.default))
    return f"`{param.default}`" if str(param.default) else '`""`'


def _names(param: click.Option, ctx: click.Context) -> str:
    names = ", ".join(f"`{n}`" for n in param.opts)
    if param.secondary_opts:
        names += " / " + ", ".join(f"`{n}`" for n in param.secondary_opts)
    if not param.is_flag:
        metavar = param.make_metavar(ctx)
        names += f" {_cell(metavar)}"
    return names


def _envvars(param: click.Parameter) -> list[str]:
    if not param.envvar:
        return []
    return [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)


def _commands(ctx: click.Context, command: click.Command, path: str):
    yield path, command, ctx
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or sub.hidden:
                continue
            yield from _commands(click.Context(sub, info_name=name, parent=ctx),
                                 sub, f"{path} {name}")


def _arguments(command: click.Command, ctx: click.Context) -> str:
    args = [p for p in command.params if isinstance(p, click.Argument)]
    return " ".join(p.make_metavar(ctx) for p in args)


def _walk() -> tuple[list[str], dict[str, list[str]]]:
    """The commands' markdown, and each environment variable with the options that read it."""
    from zeroserve.cli.main import main

    root = click.Context(main, info_name="zeroserve")
    out: list[str] = []
    envvars: dict[str, list[str]] = {}
    for path, command, ctx in _commands(root, main, "zeroserve"):
        if path == "zeroserve":
            continue
        out.append(f"## {path}\n")
        usage = f"{path} [OPTIONS] {_arguments(command, ctx)}".rstrip()
        if isinstance(command, click.Group):
            usage = f"{path} COMMAND [ARGS]..."
        out.append(f"```\n{usage}\n```\n")
        if command.help:
            out.append(_text(inspect.cleandoc(command.help.split("\f")[0])) + "\n")
        options = [p for p in command.params
                   if isinstance(p, click.Option) and not p.hidden]
        if not options:
            continue
        out.append("| option | environment variable | default | what it does |")
        out.append("| --- | --- | --- | --- |")
        for param in options:
            names = _envvars(param)
            for name in names:
                envvars.setdefault(name, []).append(f"`{path} {param.opts[0]}`")
            out.append(f"| {_names(param, ctx)} | {', '.join(f'`{n}`' for n in names)} "
                       f"| {_default(param)} | {_cell(param.help or '')} |")
        out.append("")
    return out, envvars


def render() -> str:
    """Markdown for every command and option of `zeroserve`, in the CLI's own order."""
    return "\n".join(_walk()[0]) + "\n"


def render_envvars() -> str:
    """A table of every environment variable an option reads, and the options."""
    envvars = _walk()[1]
    out = ["| environment variable | read by |", "| --- | --- |"]
    out += [f"| `{name}` | {', '.join(envvars[name])} |" for name in sorted(envvars)]
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs hook)
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, render())
    if ENV_MARKER in markdown:
        markdown = markdown.replace(ENV_MARKER, render_envvars())
    return markdown
