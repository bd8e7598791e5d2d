"""The command-line tools: ``tools.inspect`` (offline compile and report), ``tools.ir``
(show / diff / dot / html) and the runtime's per-compile dumps."""
from __future__ import annotations

import argparse
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runtime as rt
from compiler import hlo_report
from tests.irtest import check_golden
from tools import _common, inspect as tinspect, ir as tir, cache as tcache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "tests", "inspect_models.py")


def _env(devices: int | None = None) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the tool must set the device count itself
    env.pop("RT_DUMP_DIR", None)
    env.pop("RT_CACHE_DIR", None)
    env["PYTHONPATH"] = ROOT
    return env


@pytest.fixture(scope="module")
def transformer_dir(tmp_path_factory):
    """``tools.inspect`` on the transformer block's train step, 8 replicas × 4 logical
    devices = 32 virtual devices, in a fresh process."""
    out = tmp_path_factory.mktemp("inspect") / "tb"
    cmd = [sys.executable, "-m", "tools.inspect",
           "examples/transformer_block.py:train_step", "--args", f"{MODELS}:transformer_args",
           "--replicas", "8", "--logical-devices", "4", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r.stdout


def test_inspect_writes_every_file(transformer_dir):
    out, stdout = transformer_dir
    for f in ("stablehlo.mlir", "hlo.txt", "report.json"):
        assert (out / f).stat().st_size > 0, f
    names = sorted(os.listdir(out / "ir"))
    assert names == ["00-import.txt", "01-replication.txt", "02-hoist-collectives.txt",
                     "03-cross-replica-sum.txt",
                     "04-sharding.txt", "05-dce.txt"]
    for n in names:
        first = (out / "ir" / n).read_text().splitlines()[0]
        assert re.fullmatch(r"// pass: [\w-]+  time: [\d.]+ ms", first), first
        assert n[3:-4] in first
    assert "stablehlo" in (out / "stablehlo.mlir").read_text()[:2000] or \
        "func.func" in (out / "stablehlo.mlir").read_text()
    for part in ("collectives:", "memory per device:", "IR ops with the most flops",
                 "8 replicas x 4 logical devices = 32 devices"):
        assert part in stdout


def test_inspect_report_matches_hlo(transformer_dir):
    out, _ = transformer_dir
    report = json.loads((out / "report.json").read_text())
    hlo = (out / "hlo.txt").read_text()
    # our own regex over the HLO: one collective per instruction line (an async pair once)
    kinds = "|".join(re.escape(k) for k in hlo_report.KINDS)
    pat = re.compile(rf"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s({kinds})(-start)?\(", re.M)
    found = sorted(m.group(1) for m in pat.finditer(hlo))
    assert found, "the 8x4 transformer step has collectives"
    assert sorted(c["kind"] for c in report["collectives"]) == found
    assert report["num_replicas"] == 8 and report["logical_devices"] == 4
    assert report["devices"] == 32
    assert report["flops"] > 0 and report["bytes_accessed"] > 0
    mem = report["memory_per_device"]
    for k in ("argument_bytes", "output_bytes", "temp_bytes", "generated_code_bytes"):
        assert isinstance(mem[k], int) and mem[k] >= 0
    assert mem["argument_bytes"] > 0
    assert report["padding_overhead"] is None
    ins = {v["path"]: v for v in report["inputs"]}
    assert ins["args[0]['w1']"]["xla_sharding"] == "{devices=[1,4]0,1,2,3}"
    assert "model_0" in ins["args[0]['w1']"]["jax_sharding"]
    assert ins["args[1].per_replica[0]"]["replica"] == "varying"
    assert all(v["jax_sharding"] for v in report["inputs"] + report["outputs"])
    top = report["top_ops"]
    assert 0 < len(top) <= 10 and top[0]["op"] == "dot_general"
    assert [t["flops"] for t in top] == sorted((t["flops"] for t in top), reverse=True)
    assert all(t["source"].startswith("transformer_block.py:") for t in top)


def test_op_flops_estimates():
    from ir.parser import parse
    from runtime.report import op_flops
    g = parse("""func @f(%0: f32[2,8,16], %1: f32[2,16,4]) {
  %2: f32[2,8,4] = dot_general(%0, %1) {dimension_numbers=(((2,), (1,)), ((0,), (0,))), precision=None, preferred_element_type=f32}
  %3: f32[2,8,4] = tanh(%2)
  %4: f32[] = reduce_sum(%3) {axes=(0, 1, 2)}
  return %4
}""")
    assert [op_flops(op) for op in g.ops] == [2 * 2 * 8 * 4 * 16, 64, 64]


def test_flops_of_a_cond_are_its_costliest_branch():
    """One branch of a ``cond`` runs: its flops are the costlier branch's (before, the sum
    of both, twice what runs when they cost the same)."""
    from runtime.report import op_flops

    def step(w, x):
        return jax.lax.cond(x.sum() > 0, lambda: x @ w, lambda: jnp.tanh(x @ w))
    graph = rt.replicate(step, num_replicas=2).lower(
        np.ones((16, 16), np.float32), rt.distribute(np.ones((16, 16), np.float32), 2)).ir()
    cond = next(op for op in graph.ops if op.name == "cond")
    dot = 2 * 8 * 16 * 16
    assert op_flops(cond) == dot + 8 * 16  # (the tanh branch: its matmul and its tanh)


def test_inspect_dynamic_bucket_is_a_multiple_of_the_logical_devices(tmp_path, capsys):
    """With K = 3 logical devices the runtime's pow2 bucket of 12 rows is rounded up to a
    multiple of 3 (16 -> 18); the report says the bucket the program compiled for (before:
    the plain pow2 bucket; found by a probe)."""
    out = tmp_path / "dyn3"
    rc = tinspect.main([f"{MODELS}:dynamic_step", "--args", f"{MODELS}:dynamic_args",
                        "--replicas", "2", "--logical-devices", "3", "--dynamic", "pow2",
                        "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    pad = json.loads((out / "report.json").read_text())["padding_overhead"]
    assert pad["real_rows"] == [12, 12] and pad["bucket"] == 18
    assert pad["padded_fraction"] == pytest.approx(6 / 18)


def test_inspect_dynamic_reports_the_bucket_and_padding(tmp_path, capsys):
    out = tmp_path / "dyn"
    rc = tinspect.main([f"{MODELS}:dynamic_step", "--args", f"{MODELS}:dynamic_args",
                        "--replicas", "2", "--dynamic", "pow2", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    pad = report["padding_overhead"]
    assert pad["bucketing"] == "pow2" and pad["real_rows"] == [12, 12] and pad["bucket"] == 16
    assert pad["padded_fraction"] == pytest.approx(0.25)
    names = sorted(p.name for p in (out / "ir").iterdir())
    assert any(n.endswith("-padding.txt") for n in names), names
    after = next((out / "ir").glob("*-padding.txt")).read_text()
    assert "pad_mask(" in after and "f32[16,8]" in after
    assert "25.0% padding" in capsys.readouterr().out
    # each input named by its own argument: the real sizes come first (before, every
    # name sat one input early, the weight's on the size)
    labels = [(v["path"], v["type"].split(" ")[0]) for v in report["inputs"]]
    assert labels == [("(real size of dim b)", "s32[]"), ("args[0]", "f32[8,4]"),
                      ("args[1].per_replica", "f32[16,8]")], labels


def test_inspect_reexecs_when_jax_has_too_few_devices(tmp_path, capfd):
    # this process has 8 devices; 4 x 4 = 16 needs a fresh process
    assert len(jax.devices()) < 16
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        tinspect.main([f"{MODELS}:annotated_step", "--args", f"{MODELS}:annotated_args",
                       "--replicas", "8", "--logical-devices", "2", "--out", str(out), "--quiet"])
    assert e.value.code == 0, capfd.readouterr().err[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["devices"] == 16 and report["mesh"] == {"replica": 8, "model": 2}


def _all_parsers():
    yield "inspect", tinspect.build_parser()
    p = tir.build_parser()
    yield "ir", p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                yield f"ir {name}", sp
    p = tcache.build_parser()
    yield "cache", p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sp in action.choices.items():
                yield f"cache {name}", sp


def test_help_documents_every_option():
    for label, p in _all_parsers():
        text = p.format_help()
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert a.help and a.help.strip(), f"{label}: {a.option_strings or a.dest} has no help"
            for s in a.option_strings:
                assert s in text, f"{label}: {s} missing from --help"
    assert "--dynamic" in tinspect.build_parser().format_help()


def test_help_runs_for_every_command():
    for args in (["tools.inspect"], ["tools.ir"], ["tools.ir", "diff"], ["tools.ir", "dot"],
                 ["tools.ir", "html"], ["tools.ir", "show"], ["tools.cache", "explain"]):
        r = subprocess.run([sys.executable, "-m", *args, "--help"], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "usage:" in r.stdout, (args, r.stderr)


def test_console_scripts_declared():
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert 'replicate-inspect = "tools.inspect:main"' in text


# ------------------------------------------------------------------------- tools.ir

def _ir(capsys, *argv) -> str:
    assert tir.main(list(argv)) == 0
    return capsys.readouterr().out


def test_ir_show_from_inspect_dir(transformer_dir, capsys):
    out, _ = transformer_dir
    text = _ir(capsys, "show", str(out), "--after", "sharding")
    want = (out / "ir" / "04-sharding.txt").read_text().split("\n", 1)[1].strip()
    assert text.startswith("// after pass: sharding\n")
    assert want in text
    listing = _ir(capsys, "show", str(out), "--list")
    assert [ln.split()[0] for ln in listing.splitlines()] == [
        "import", "replication", "hoist-collectives", "cross-replica-sum", "sharding", "dce"]


def test_ir_show_unknown_pass(transformer_dir, capsys):
    out, _ = transformer_dir
    assert tir.main(["show", str(out), "--after", "padding"]) == 2
    assert "no pass 'padding'" in capsys.readouterr().err


ANNOTATED = [f"{MODELS}:annotated_step", "--args", f"{MODELS}:annotated_args",
             "--replicas", "2", "--logical-devices", "2"]


def test_ir_diff_sharding_golden(capsys):
    """The diff over the sharding pass lists exactly the values whose type the pass
    changed (checked independently, value by value), in a stable text."""
    text = _ir(capsys, "diff", *ANNOTATED, "cross-replica-sum", "sharding")
    check_golden("ir_diff_sharding.out.txt", text)
    # independent oracle: the sharding pass keeps every op, so values match by position
    ns = tir.build_parser().parse_args(["show", *ANNOTATED])
    stages = {n: g for n, _, g in tir.load_passes(ns, [])}
    a, b = stages["cross-replica-sum"], stages["sharding"]
    from ir.printer import value_names
    va = list(a.inputs) + [r for op, _ in a.walk() for r in op.results]
    vb = list(b.inputs) + [r for op, _ in b.walk() for r in op.results]
    names = value_names(b)
    changed = {names[y] for x, y in zip(va, vb) if str(x.type) != str(y.type)}
    shown = {ln.split(" ", 1)[0] for ln in text.splitlines()[1:] if ln.startswith("%")}
    assert shown == changed and changed
    assert "ops added" not in text and "ops removed" not in text


def test_ir_diff_matches_values_across_removed_ops(capsys):
    argv = [f"{MODELS}:dead_code_step", "--args", f"{MODELS}:dead_code_args", "--replicas", "2"]
    text = _ir(capsys, "diff", *argv, "sharding", "dce")
    # dce shifts every later name (%7 -> %2 ...) but changes no value's type
    assert not [ln for ln in text.splitlines() if ln.startswith("%")], text
    assert "ops removed (5):" in text
    assert re.search(r"- %2 \(sin inspect_models\.py:\d+", text)
    text = _ir(capsys, "diff", *argv, "replication", "dce")
    assert "%2 (was %7) (cast_varying" in text


def _check_dot(text: str, graph) -> None:
    """Our own structural check of the DOT we write (Graphviz is optional)."""
    lines = text.strip().splitlines()
    assert re.fullmatch(r'digraph "(?:[^"\\]|\\.)*" \{', lines[0]) and lines[-1] == "}"
    depth = 0
    for ln in lines:
        stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', ln)  # braces inside labels do not count
        depth += stripped.count("{") - stripped.count("}")
        assert depth >= 0
    assert depth == 0
    stmt = re.compile(r'^\s*(?:\w+ -> \w+ \[label="[^"]*"\];|\w+ \[.*\];|rankdir=TB;|'
                      r'(?:node|edge) \[.*\];|subgraph \w+ \{|label=".*"; style=\w+;|\}|'
                      r'digraph ".*" \{)$')
    for ln in lines:
        assert stmt.match(ln), ln
    edges = [ln for ln in lines if " -> " in ln]
    nodes = {ln.split()[0] for ln in lines if re.match(r"^\s*(in|op|out)\d+ \[", ln)}
    assert len(edges) == sum(len(op.operands) for op in graph.ops) + len(graph.outputs)
    for e in edges:
        a, _, b = e.split()[:3]
        assert a in nodes and b in nodes
    assert len(nodes) == len(graph.inputs) + len(graph.ops) + len(graph.outputs)


def test_ir_dot(tmp_path, capsys):
    out = tmp_path / "g.dot"
    _ir(capsys, "dot", *ANNOTATED, "--after", "sharding", "-o", str(out))
    text = out.read_text()
    ns = tir.build_parser().parse_args(["show", *ANNOTATED])
    graph = {n: g for n, _, g in tir.load_passes(ns, [])}["sharding"]
    _check_dot(text, graph)
    assert "cluster_legend" in text and "{devices=[1,2]0,1}" in text
    colors = set(re.findall(r'fillcolor="(#[0-9a-f]{6})"', text))
    assert len(colors) >= 3  # {replicated}, [1,2] and [2,1] differ
    if shutil.which("dot"):
        r = subprocess.run(["dot", "-Tsvg", str(out)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "<svg" in r.stdout, r.stderr


class _TagChecker(html.parser.HTMLParser):
    VOID = {"meta", "br", "img", "link", "input", "hr"}

    def __init__(self):
        super().__init__()
        self.stack, self.tags, self.spans = [], [], 0

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in self.VOID:
            self.stack.append(tag)
        if tag == "span":
            self.spans += 1

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-5:])
        self.stack.pop()


def test_ir_html(tmp_path, capsys):
    out = tmp_path / "g.html"
    _ir(capsys, "html", *ANNOTATED, "--after", "sharding", "-o", str(out))
    text = out.read_text()
    p = _TagChecker()
    p.feed(text)
    p.close()
    assert p.stack == []
    assert "script" not in p.tags and "link" not in p.tags and "http" not in text
    assert "Legend" in text
    for s in ("{replicated}", "{devices=[1,2]0,1}", "{devices=[2,1]0,1}"):
        assert f"<code>{s}</code>" in text
    assert p.spans > 40  # every value definition and use is coloured


# -------------------------------------------------------------------- runtime dumps

def _dump_step(w, x):
    return jnp.tanh(x @ w).sum()


@pytest.mark.parametrize("via_env", [False, True])
def test_runtime_dumps_one_folder_per_compile(tmp_path, monkeypatch, via_env):
    d = tmp_path / "dump"
    if via_env:
        monkeypatch.setenv("RT_DUMP_DIR", str(d))
        step = rt.replicate(_dump_step, num_replicas=2)
    else:
        monkeypatch.delenv("RT_DUMP_DIR", raising=False)
        step = rt.replicate(_dump_step, num_replicas=2, options=rt.RunOptions(dump_dir=str(d)))
    w = np.ones((4, 2), np.float32)
    step(w, rt.distribute(np.ones((6, 4), np.float32), 2))
    step(w, rt.distribute(np.ones((6, 4), np.float32), 2))  # a hit: no new folder
    step(w, rt.distribute(np.ones((8, 4), np.float32), 2))  # a new shape: a new compile
    subs = sorted(os.listdir(d))
    assert len(subs) == 2 and all(re.fullmatch(r"_dump_step-[0-9a-f]{10}", s) for s in subs)
    for s in subs:
        for f in ("stablehlo.mlir", "hlo.txt", "report.json", "ir/00-import.txt", "ir/05-dce.txt"):
            assert (d / s / f).exists(), (s, f)
        rep = json.loads((d / s / "report.json").read_text())
        assert rep["function"] == "_dump_step" and rep["num_replicas"] == 2
        assert [c["kind"] for c in rep["collectives"]] == \
            [c.kind for c in hlo_report.collectives((d / s / "hlo.txt").read_text())]
    assert not any(f.endswith(".txt") for f in os.listdir(d))  # nothing at the top level


def test_a_dynamic_steps_dump_reports_its_padding(tmp_path):
    """A dynamic-shape program's dump says the padding of the call it was compiled for
    (5 real rows per replica in a pow2 bucket of 8: 37.5%); before, "no dynamic shapes"
    (found by a probe)."""
    from runtime.report import summary
    d = tmp_path / "dump"
    step = rt.replicate(_dump_step, num_replicas=2,
                        options=rt.RunOptions(dump_dir=str(d), dynamic_shapes=True))
    step(np.ones((4, 2), np.float32), rt.distribute(np.ones((10, 4), np.float32), 2))
    (sub,) = os.listdir(d)
    rep = json.loads((d / sub / "report.json").read_text())
    assert rep["padding_overhead"] == {"bucketing": "pow2", "real_rows": [5, 5], "bucket": 8,
                                       "padded_fraction": 0.375}
    assert summary(rep).splitlines()[-1] == ("padding overhead (pow2): rows per replica [5, 5] "
                                             "-> bucket 8: 37.5% padding")


def test_report_is_one_shared_module():
    import inspect as pyinspect
    src = pyinspect.getsource(tinspect)
    assert "runtime.report" in src and "cost_analysis" not in src
    assert "write_dump" in pyinspect.getsource(__import__("runtime.program", fromlist=["x"]))


def test_xla_flags_rewrite():
    f = _common.xla_flags_with_devices("--foo --xla_force_host_platform_device_count=8", 32)
    assert f == "--foo --xla_force_host_platform_device_count=32"
