"""The tree keeps the shape docs/architecture.md describes: no module of compiler/ or runtime/ imports one
that imports it back; a runtime module imports only its own layer or those below it; and no module outside
the family modules branches on a family's name (a new family is its modules, not edits to dispatch code).
Read from the source with `ast`, so a failure names the file and the import or literal."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# runtime/, bottom to top: a module may import its own layer and the ones below, never one above.
RUNTIME_LAYERS = [
    # 0: standard library and numpy only
    {"errors", "fileops", "fingerprint", "cpu", "progress", "flow", "protobuf", "trt_header", "openvino_attention",
     "tokenizer", "prompts", "devices.device", "families.family", "sigmas", "multistep", "sampler_names", "previews",
     "oci", "oci.ref", "vae_tiling", "vae_segments", "blob_pages"},
    # 1: formats, records and one-file readers
    {"png", "verified", "schedulers", "sentencepiece_model", "onnx_header", "staging", "digests", "embeddings",
     "llm_tokenizer", "cli_support", "metadata", "devices.sysfs", "devices.amd", "devices.intel", "devices.nvidia",
     "devices.macos", "devices.windows", "oci.auth", "oci.transport", "oci.client", "oci.stream"},
    # 2: what a bundle and a machine are
    {"checks", "manifest_schema", "manifest", "t5_tokenizer", "images", "devices", "oci.artifact", "oci.store_gc"},
    # 3: placing, choosing and opening what runs
    {"assign", "image_size", "control", "sessions", "budgets", "select", "hires", "text_encoders"},
    # 4: a bundle opened to generate
    {"vae_passes", "loading"},
    # 5: the families
    {"families", "families.flow_matching", "families.sd", "families.flux", "families.sd3", "families.zimage",
     "families.flux2", "families.qwenimage"},
    # 6: the Python API
    {"report", "component", "step_hooks", "generate", "api", "oci.push", "oci.pull", "oci.store"},
    # 7: the command line, and the package (which re-exports the API lazily)
    {"run_commands", "doctor_command", "rerun", "remote_commands", "cli", ""},
]


def _modules(tree: str) -> dict[str, Path]:
    out = {}
    for p in (ROOT / tree).rglob("*.py"):
        parts = list(p.relative_to(ROOT / tree).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(tree: str) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports (relative imports, at any depth)."""
    mods = _modules(tree)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        package = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        if m == "":
            package = []
        for node in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
            if node.level - 1 > len(package):
                continue                                     # leaves the tree (..runtime from compiler/)
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                name = f"{target}.{alias.name}".lstrip(".")
                hit = name if name in mods else target.lstrip(".")
                if hit in mods and hit != m:
                    edges[m].add(hit)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in edges:
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("tree", ["compiler", "runtime"])
def test_no_module_imports_one_that_imports_it_back(tree):
    assert _cycles(_imports(tree)) == []


def test_runtime_modules_import_their_layer_or_below():
    layer = {m: i for i, names in enumerate(RUNTIME_LAYERS) for m in names}
    edges = _imports("runtime")
    unplaced = sorted(set(edges) - set(layer))
    assert not unplaced, f"runtime modules with no layer in RUNTIME_LAYERS (place each): {unplaced}"
    upward = sorted(f"runtime/{a or '__init__'} (layer {layer[a]}) imports {b} (layer {layer[b]})"
                    for a, targets in edges.items() for b in targets if layer[b] > layer[a])
    assert not upward, upward


# Per-family by nature: the demo writers make one tiny file per family (compiler/demo_*.py).
NAMES_FAMILIES = {"compiler/demo_dit.py", "compiler/demo_families.py", "compiler/demo_lora.py", "compiler/demo_model.py"}


def test_only_the_family_modules_name_a_family():
    """A string literal equal to a family's name ("sd1", "flux", ...) appears only in compiler/families/,
    runtime/families/ and the demo writers: everything else asks the registries."""
    from precast.compiler.families import FAMILIES as COMPILER_FAMILIES
    from precast.runtime.families import FAMILIES as RUNTIME_FAMILIES
    names = set(COMPILER_FAMILIES) | set(RUNTIME_FAMILIES)
    assert {"sd1", "sdxl", "flux", "sd3"} <= names
    found = []
    for tree in ("compiler", "runtime"):
        for p in sorted((ROOT / tree).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if "families" in p.relative_to(ROOT).parts or rel in NAMES_FAMILIES:
                continue
            found += [f"{rel}:{n.lineno}: {n.value!r}" for n in ast.walk(ast.parse(p.read_text()))
                      if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names]
    assert not found, found
