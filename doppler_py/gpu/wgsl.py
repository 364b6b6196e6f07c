"""WGSL source text: the shader folder and its files, the text adapted for naga (no `enable subgroups;`, or pruned
to one entry point for devices without subgroups), and the bindings and uniform struct a source declares.

Tint (Dawn, Chrome) compiles the files as they are; only naga (wgpu-py) gets the adapted text. Override constants
are not parsed here: the registry passes them to the pipeline (`KernelRegistry.kernel`).
"""

from __future__ import annotations

import importlib.resources
import re
from dataclasses import dataclass
from pathlib import Path

from doppler_py.errors import ShaderError
from doppler_py.gpu.uniforms import _SCALAR_FORMATS, UniformLayout


def _shader_dir() -> Path:
    """The WGSL folder: doppler_py/shaders in an installed wheel (the build maps the repository's top-level shaders/
    there, see pyproject.toml), the checkout's own shaders/ beside the package in a source tree or editable install."""
    package = Path(str(importlib.resources.files("doppler_py"))).resolve()
    installed, checkout = package / "shaders", package.parent / "shaders"
    # The installed copy wins; the checkout's only when the package has none, so a wheel never reads a stray
    # site-packages/shaders of another distribution.
    return checkout if not installed.is_dir() and checkout.is_dir() else installed


SHADER_DIR = _shader_dir()

_BINDING_RE = re.compile(
    r"@group\(\s*0\s*\)\s*@binding\(\s*(\d+)\s*\)\s*var\s*<\s*(uniform|storage)\s*(?:,\s*(read_write|read))?\s*>"
    r"\s*(\w+)\s*:\s*([\w<>, ]+?)\s*;"
)
_STRUCT_RE = re.compile(r"struct\s+(\w+)\s*\{([^}]*)\}", re.S)
_FIELD_RE = re.compile(r"(\w+)\s*:\s*(\w+)")
_ENABLE_SUBGROUPS_RE = re.compile(r"^\s*enable\s+subgroups\s*;\s*$", re.M)
_COMMENT_RE = re.compile(r"//[^\n]*")


def read_shader(name: str, shader_dir: Path = SHADER_DIR) -> str:
    path = shader_dir / f"{name}.wgsl"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in shader_dir.glob("*.wgsl")))
        if not known:  # not a typo in `name`: a package built without its WGSL files
            raise ShaderError(
                f"no WGSL files in {shader_dir}: this installation of doppler-py was built without its shaders; "
                "reinstall it"
            )
        raise ShaderError(f"no shader named {name!r} in {shader_dir} (known: {known})")
    return path.read_text()


def source_for_naga(source: str) -> str:
    """naga (wgpu-py) rejects `enable subgroups;` which Tint requires; the builtins work without it."""
    return _ENABLE_SUBGROUPS_RE.sub("", source)


@dataclass(frozen=True)
class Binding:
    index: int
    name: str
    kind: str  # "uniform", "read-only-storage" or "storage"
    type_name: str


def parse_bindings(source: str) -> list[Binding]:
    text = _COMMENT_RE.sub("", source)
    bindings = []
    for m in _BINDING_RE.finditer(text):
        index, space, access, name, type_name = m.groups()
        if space == "uniform":
            kind = "uniform"
        else:
            kind = "storage" if access == "read_write" else "read-only-storage"
        bindings.append(Binding(int(index), name, kind, type_name.strip()))
    return sorted(bindings, key=lambda b: b.index)


_FN_RE = re.compile(r"\bfn\s+(\w+)\s*\(")
_IDENT_RE = re.compile(r"\b[A-Za-z_]\w*\b")


_ATTRIBUTES_BEFORE_RE = re.compile(r"(?:@\w+\s*(?:\([^)]*\))?\s*)*$")


def _blank_comments(source: str) -> str:
    """Comments replaced by spaces of the same length, so positions still match the source."""
    return _COMMENT_RE.sub(lambda m: " " * len(m.group(0)), source)


def _function_spans(text: str) -> dict[str, tuple[int, int, int]]:
    """Each WGSL function's name → (start incl. attributes, body start, end), brace-matched."""
    spans = {}
    for m in _FN_RE.finditer(text):
        body = text.index("{", m.end())
        depth, i = 0, body
        while True:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                break
        start = _ATTRIBUTES_BEFORE_RE.search(text, 0, m.start()).start()
        spans[m.group(1)] = (start, body, i)
    return spans


def _function_bodies(text: str) -> dict[str, str]:
    """Each WGSL function's name → its body text."""
    return {name: text[body:end] for name, (_, body, end) in _function_spans(text).items()}


def _reachable(bodies: dict[str, str], entry: str) -> tuple[set[str], set[str]]:
    """Functions reachable from `entry` and every identifier their bodies use."""
    seen, todo, used = set(), [entry], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        idents = set(_IDENT_RE.findall(bodies[name]))
        used |= idents
        todo.extend(idents & bodies.keys())
    return seen, used


def prune_to_entry(source: str, entry: str) -> str:
    """The source with only `entry` and the functions it calls, without `enable subgroups;`.

    For devices without subgroups: a file's subgroup entry point would make the whole module fail to compile
    there, so each non-subgroup entry point is compiled from its own pruned module.
    """
    text = _blank_comments(source)
    spans = _function_spans(text)
    if entry not in spans:
        raise ShaderError(f"entry point {entry!r} not found (functions: {sorted(spans)})")
    keep, _ = _reachable(_function_bodies(text), entry)
    pieces, last = [], 0
    for name, (start, _, end) in sorted(spans.items(), key=lambda item: item[1][0]):
        if name not in keep:
            pieces.append(source[last:start])
            last = end
    pieces.append(source[last:])
    return source_for_naga("".join(pieces))


def entry_bindings(source: str, entry: str, bindings: list[Binding]) -> list[Binding]:
    """The bindings that `entry` reaches through its call graph.

    A file may hold several entry points that share helper functions but not all resources; like WebGPU's
    "auto" layout, each pipeline's bind group holds only what its entry point uses.
    """
    bodies = _function_bodies(_COMMENT_RE.sub("", source))
    if entry not in bodies:
        raise ShaderError(f"entry point {entry!r} not found (functions: {sorted(bodies)})")
    _, used = _reachable(bodies, entry)
    return [b for b in bindings if b.name in used]


def parse_uniform(source: str, bindings: list[Binding]) -> UniformLayout | None:
    uniforms = [b for b in bindings if b.kind == "uniform"]
    if not uniforms:
        return None
    if len(uniforms) > 1:
        raise ShaderError(f"at most one uniform binding per shader, found {[b.name for b in uniforms]}")
    text = _COMMENT_RE.sub("", source)
    structs = {m.group(1): m.group(2) for m in _STRUCT_RE.finditer(text)}
    type_name = uniforms[0].type_name
    if type_name not in structs:
        raise ShaderError(f"uniform {uniforms[0].name}: struct {type_name} not found")
    fields = tuple(_FIELD_RE.findall(structs[type_name]))
    for name, kind in fields:
        if kind not in _SCALAR_FORMATS:
            raise ShaderError(f"uniform struct {type_name}.{name}: only u32/i32/f32 fields are supported")
    return UniformLayout(type_name, fields)
