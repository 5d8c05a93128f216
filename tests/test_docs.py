"""The documentation a new user follows, checked against the code it describes: the example CI workflow
(docs/github-actions-build.yml) installs precast from its own checkout, never by name from the package index
(precast is not there), each `precast` command it runs exists and parses with the options it passes, and it
keeps the remote build cache and the bundles in GHCR (no actions/cache, no artifacts); docs/cli.md
is the --help of today's commands (tests/cli_reference.py writes it); docs/recipes.md names every recipe field
and target option compiler/recipe.py and compiler/targets accept, and none they refuse; docs/architecture.md
names every module; every relative link in README.md and docs/*.md reaches a file (and a heading)."""
import difflib
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import click
import pytest
import yaml

import cli_reference
from conftest import ROOT, precast

DOCS = Path(ROOT, "docs")
WORKFLOW = DOCS / "github-actions-build.yml"
PAGES = [Path(ROOT, "README.md"), *sorted(DOCS.glob("*.md"))]


# ---- the example workflow -------------------------------------------------------------------------------

def _jobs() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())["jobs"]


def _commands(script: str, program: str) -> list[list[str]]:
    """Each `program ...` command in a run: script as argv (GitHub's ${{ }} expressions made one word; a
    command ends at a shell operator or the `)` of a $(...) around it)."""
    script = re.sub(r"\$\{\{[^}]*\}\}", "X", script)
    return [shlex.split(m.group(1)) for m in re.finditer(rf"(?:^|[\s($;&|])({re.escape(program)}\s[^;&|)>\n]*)",
                                                         script)]


def _precast_commands() -> list[list[str]]:
    return [argv[1:] for job in _jobs().values() for step in job["steps"]
            for argv in _commands(step.get("run", ""), "precast")]


def _resolve(argv: list[str]) -> tuple[tuple[str, ...], click.Command, list[str]]:
    """(the command path, its click command, the rest of argv) through the real `precast` group."""
    from precast.runtime.cli import main
    ctx, cmd, path, rest = click.Context(main, info_name="precast"), main, (), list(argv)
    while isinstance(cmd, click.Group) and rest and not rest[0].startswith("-"):
        name = rest.pop(0)
        sub = cmd.get_command(ctx, name)
        assert sub is not None, f"docs/github-actions-build.yml runs `precast {' '.join(argv)}`: no command {name!r}"
        path, cmd, ctx = (*path, name), sub, click.Context(sub, info_name=name, parent=ctx)
    return path, cmd, rest


def test_the_workflows_precast_commands_exist_and_take_their_options():
    commands = _precast_commands()
    assert len(commands) >= 6, commands            # plan, build, bundle merge / verify / inspect / pack
    resolved = [_resolve(argv) for argv in commands]
    paths = sorted({p for p, _, _ in resolved})
    with ThreadPoolExecutor(8) as pool:            # the real CLI, one process per command, at once
        helps = dict(zip(paths, pool.map(lambda p: precast(*p, "--help"), paths)))
    for path, cmd, rest in resolved:
        proc = helps[path]
        assert proc.returncode == 0 and proc.stdout.startswith("Usage: "), (path, proc.stderr)
        assert not isinstance(cmd, click.Group), f"`precast {' '.join(path)}` is a group, not a command"
        options = {o: p for p in cmd.params if isinstance(p, click.Option) for o in p.opts}
        for i, word in enumerate(rest):
            if not word.startswith("--"):
                continue
            name = word.split("=", 1)[0]
            assert name in options, f"`precast {' '.join(path)}` has no option {name} (docs/github-actions-build.yml)"
            assert name in proc.stdout, (name, proc.stdout)
            param = options[name]
            if isinstance(param.type, click.Choice) and not param.is_flag:
                value = word.split("=", 1)[1] if "=" in word else rest[i + 1]
                assert value in param.type.choices, f"precast {' '.join(path)} {name} {value}: not one of its choices"


def test_the_workflows_precast_commands_parse():
    """Each command's arguments and options parse as the command reads them (arity, required options, values),
    without running it."""
    for argv in _precast_commands():
        path, cmd, rest = _resolve(argv)
        try:
            cmd.make_context(" ".join(("precast", *path)), list(rest))
        except click.UsageError as e:
            raise AssertionError(f"docs/github-actions-build.yml: `precast {' '.join(argv)}`: {e.format_message()}")


def _runs() -> str:
    """Every step's script, with the values GitHub gives its variables in a run of repository Acme/precast."""
    text = "\n".join(step.get("run", "") for job in _jobs().values() for step in job["steps"])
    for name, value in (("${GITHUB_REPOSITORY,,}", "acme/precast"), ("$GHCR", "ghcr.io/acme/precast"),
                        ("$GITHUB_RUN_ID", "7"), ("$GITHUB_SHA", "0" * 40), ("$i", "0")):
        text = text.replace(name, value)
    return re.sub(r"\$\{\{[^}]*\}\}", "1", text)


def test_the_workflow_keeps_caches_and_bundles_in_ghcr():
    """The remote build cache and the bundles live in GHCR (the job's token may write packages); nothing goes
    through actions/cache or workflow artifacts; every oci:// reference parses, and every PRECAST_ variable it
    sets is one precast reads."""
    from precast.compiler.remote_cache import RemoteCache, remote_cache
    from precast.runtime.oci.ref import parse_ref
    doc = yaml.safe_load(WORKFLOW.read_text())
    assert doc["permissions"]["packages"] == "write"
    uses = [str(step.get("uses", "")).split("@")[0] for job in doc["jobs"].values() for step in job["steps"]]
    assert not {"actions/cache", "actions/upload-artifact", "actions/download-artifact"} & set(uses), uses
    runs = _runs()
    refs = [parse_ref(r, need_reference=False) for r in re.findall(r"oci://[^\s\"'>]+", runs)]
    assert refs and {r.host for r in refs} == {"ghcr.io"}, refs
    caches = set(re.findall(r"PRECAST_REMOTE_CACHE=([^\s\"']+)", runs))
    assert caches and all(isinstance(remote_cache(c), RemoteCache) for c in caches)     # a repository, no tag
    pushed = [argv for argv in _commands(runs, "precast") if argv[1:2] == ["push"]]
    assert pushed and all(parse_ref(argv[3]).tag for argv in pushed)
    source = "\n".join(p.read_text() for d in ("compiler", "runtime") for p in Path(ROOT, d).rglob("*.py"))
    names = set(re.findall(r"\bPRECAST_[A-Z_]+", WORKFLOW.read_text()))
    assert {"PRECAST_REMOTE_CACHE", "PRECAST_REMOTE_CACHE_PUSH", "PRECAST_REGISTRY_USERNAME"} <= names
    assert [n for n in sorted(names) if f'"{n}"' not in source] == [], "variables precast does not read"


def test_the_workflow_installs_precast_from_its_checkout_not_the_index():
    """precast is not on the package index: `pip install 'precast[...]'` fails in a fresh runner."""
    for name, job in _jobs().items():
        steps = job["steps"]
        runs = [step.get("run", "") for step in steps]
        installs = [(i, argv) for i, run in enumerate(runs) for argv in _commands(run, "pip")
                    if argv[1:2] == ["install"]]
        for _, argv in installs:
            by_name = [a for a, after in zip(argv[2:], [*argv[3:], ""]) if after != "@"      # `precast @ URL` is fine
                       and re.fullmatch(r"precast(\[[^\]]*\])?\s*([<>=!~;].*)?", a)]
            assert not by_name, f"job {name}: `{' '.join(argv)}` installs precast by name from the package index"
        uses_precast = [i for i, run in enumerate(runs) if _commands(run, "precast")]
        if not uses_precast:
            continue
        checkout = next((i for i, s in enumerate(steps) if str(s.get("uses", "")).startswith("actions/checkout@")),
                        None)
        local = [i for i, argv in installs if any(a == "." or a.startswith(".[") for a in argv[2:])]
        assert checkout is not None and local and checkout < local[0] < uses_precast[0], \
            f"job {name}: check out the repository, then pip install '.[...]', before running precast"


# ---- generated and checked references -------------------------------------------------------------------

def test_cli_reference_is_todays_help():
    want, have = cli_reference.render(), (DOCS / "cli.md").read_text()
    diff = list(difflib.unified_diff(have.splitlines(), want.splitlines(), "docs/cli.md", "now", lineterm="", n=1))
    assert not diff, (f"docs/cli.md differs from the commands' --help; regenerate it: {cli_reference.REGENERATE}\n"
                      + "\n".join(diff[:30]))


def _section(text: str, heading: str) -> str:
    """The text under `## heading` or `### heading`, up to the next heading of the same or a higher level."""
    m = re.search(rf"^(#+) {re.escape(heading)}$", text, re.M)
    assert m, f"docs/recipes.md has no section `{heading}`"
    rest = text[m.end():]
    end = re.search(rf"^#{{1,{len(m.group(1))}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def _table_fields(section: str) -> set[str]:
    """The `names` in the first cell of each table row."""
    return {name for row in re.findall(r"^\| (.*?) \|", section, re.M) for name in re.findall(r"`([^`]+)`", row)}


def _refused_fields(tmp_path, text: str) -> set[str]:
    """The fields a recipe's error lists as allowed after an unknown one (`...; allowed: a, b`)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    proc = precast("plan", recipe)
    assert proc.returncode == 2, proc.stderr
    return set(proc.stderr.strip().rsplit("allowed: ", 1)[1].split(", "))


def test_recipe_page_names_every_field_the_schema_reads_and_no_other(tmp_path):
    from precast.compiler import recipe
    from precast.compiler.families import FAMILIES, SET_FIELDS
    from precast.compiler.targets import ALIASES, OPTIONS
    text = (DOCS / "recipes.md").read_text()
    nets = _refused_fields(tmp_path, "model: {source: demo:tiny-sd15}\ntargets: [onnxruntime]\ncontrolnets: [{x: 1}]\n")
    preview = _refused_fields(tmp_path, "model: {source: demo:tiny-sd15}\ntargets: [onnxruntime]\npreview: {x: 1}\n")
    want = {"Top level": recipe.TOP_FIELDS, "model": recipe.MODEL_FIELDS,
            "model.set": {f"{c}.{f}" for c, fs in SET_FIELDS.items() for f in fs},
            "precision": {"default", *recipe.COMPONENTS}, "loras": {f.name for f in fields(recipe.Lora)},
            "controlnets": nets, "preview": preview, "profiles": recipe.PROFILE_FIELDS,
            **{t: set(o) for t, o in OPTIONS.items()}}
    for heading, names in want.items():
        have = _table_fields(_section(text, heading))
        assert have == names, (f"docs/recipes.md, section {heading}: undocumented {sorted(names - have)}, "
                               f"not accepted {sorted(have - names)}")
    assert set(re.findall(r"`(demo:[\w-]+)`", text)) == set(recipe.DEMO_SOURCES)
    model = _section(text, "model")
    assert [f for f in FAMILIES if f"`{f}`" not in model] == []
    targets = _section(text, "targets")
    assert set(re.findall(r"^### (\S+)$", targets, re.M)) == set(OPTIONS)
    assert [a for a in ALIASES if f"`{a}`" not in targets] == []


def test_architecture_page_names_every_module():
    text = (DOCS / "architecture.md").read_text()
    modules = sorted(p.relative_to(ROOT).as_posix() for d in ("compiler", "runtime")
                     for p in Path(ROOT, d).rglob("*.py"))
    assert len(modules) > 80
    unnamed = [m for m in modules if f"`{m}`" not in text]
    assert not unnamed, f"docs/architecture.md does not name {unnamed}: add a line for each"


# ---- links ----------------------------------------------------------------------------------------------

def _anchors(page: Path) -> set[str]:
    """GitHub's anchor for each heading of a Markdown page (code blocks skipped)."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_heading(page):
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
