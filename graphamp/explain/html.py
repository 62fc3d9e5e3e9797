"""``Explanation.to_html``: one self-contained page (inline CSS and a few lines of JS, no network)."""

from __future__ import annotations

import html
import math
from typing import Any

# The records rendered (graphamp.explain's Explanation, ModuleRecord, NodeRecord) are read by
# attribute; this module does not import them, so that explain can import it.
Explanation = ModuleRecord = NodeRecord = Any

__all__ = ["render"]

_CSS = """
body{font:13px/1.4 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:12px 20px}
header h1{font-size:17px;margin:0 0 4px}
header .sub{color:#b8c0d0}
main{padding:14px 20px;display:grid;grid-template-columns:minmax(640px,760px) 1fr;gap:16px;align-items:start}
section.table{grid-column:1/-1}
section{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:10px 12px;overflow:auto}
section.wide{grid-column:1/-1}
h2{font-size:14px;margin:2px 0 8px}
.alert{background:#fdecec;border:1px solid #e5a3a3;color:#8a1c1c;border-radius:6px;padding:8px 12px;margin-bottom:8px}
.okay{background:#e9f6ee;border:1px solid #9fd0b0;color:#1e5e34;border-radius:6px;padding:8px 12px;margin-bottom:8px}
.legend span{display:inline-block;margin-right:14px}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;vertical-align:-2px;margin-right:4px}
.tree summary{list-style:none;cursor:pointer}
.tree summary::-webkit-details-marker{display:none}
.row{display:grid;grid-template-columns:minmax(250px,1fr) 64px 56px 130px 56px;gap:8px;align-items:center;padding:2px 4px;border-radius:3px;white-space:nowrap}
.row:hover{outline:1px solid #9aa6bb}
.name{overflow:hidden;text-overflow:ellipsis}
.name .t{color:#6b7488;font-size:11px;margin-left:4px}
.mix{height:10px;border-radius:2px;display:flex;overflow:hidden;background:#e4e7ec}
.bar{height:8px;background:#e4e7ec;border-radius:2px;position:relative}
.bar i{display:block;height:8px;border-radius:2px;background:#5b6b8c}
.bar.bad i{background:#d03b3b}
.num{font-variant-numeric:tabular-nums;color:#4a5365;font-size:12px;text-align:right}
.badge{display:inline-block;border-radius:8px;padding:0 6px;font-size:11px;margin-left:4px}
.inf{background:#d03b3b;color:#fff}
.kept{background:#e8912d;color:#fff}
table{border-collapse:collapse;width:100%;font-size:12px}
th,td{border-bottom:1px solid #eceef2;padding:3px 6px;text-align:left;vertical-align:top}
th{position:sticky;top:0;background:#f0f2f5;cursor:pointer}
td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.over td{background:#fdecec}
tr.first td{background:#f8c9c9;font-weight:600}
.dt{border-radius:3px;padding:0 4px;color:#fff;font-size:11px}
input[type=search]{width:340px;padding:4px 8px;border:1px solid #c4cad6;border-radius:4px;margin-bottom:6px}
.casts{color:#6b7488;font-size:11px}
"""

_JS = """
const q=document.getElementById('q'),rows=[...document.querySelectorAll('#nodes tbody tr')],cnt=document.getElementById('cnt');
const oth=document.getElementById('oth');oth.addEventListener('change',filter);
function filter(){const s=q.value.toLowerCase();let n=0;for(const r of rows){const v=(!s||r.dataset.k.includes(s))&&(oth.checked||!r.classList.contains('other'));r.style.display=v?'':'none';n+=v}cnt.textContent=n+' of '+rows.length+' nodes'}
q.addEventListener('input',filter);filter();
document.querySelectorAll('.row[data-path]').forEach(e=>e.addEventListener('dblclick',()=>{q.value=e.dataset.path;filter();q.scrollIntoView()}));
document.querySelectorAll('#nodes th').forEach((th,i)=>th.addEventListener('click',()=>{const tb=th.closest('table').tBodies[0],num=th.classList.contains('n'),dir=th.dataset.d=th.dataset.d==='1'?'-1':'1';
[...tb.rows].sort((a,b)=>{let x=a.cells[i].dataset.v??a.cells[i].textContent,y=b.cells[i].dataset.v??b.cells[i].textContent;if(num){x=parseFloat(x);y=parseFloat(y);x=isNaN(x)?-1e300:x;y=isNaN(y)?-1e300:y;return (x-y)*dir}return x.localeCompare(y)*dir}).forEach(r=>tb.appendChild(r))}));
"""

_LOW, _FP32, _OTHER = "#3d7dd8", "#e8912d", "#a9b0bd"


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _g(x: float | None, fmt: str = ".2g") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _bar_width(rel: float | None) -> float:
    """A relative error on a log scale: 1e-6 (or better) is empty, 1 (or worse) is full."""
    if rel is None or rel <= 0:
        return 0.0
    return max(0.0, min(1.0, (math.log10(rel) + 6) / 6))


def _mix(m: ModuleRecord) -> str:
    if not m.ops:
        return '<div class="mix" title="no op nodes"></div>'
    parts = [(m.ops_low, _LOW, "low precision"), (m.ops_fp32, _FP32, "fp32"), (m.ops_other, _OTHER, "other")]
    spans = "".join(f'<span style="width:{100 * n / m.ops:.1f}%;background:{c}"></span>' for n, c, _ in parts if n)
    title = ", ".join(f"{n} {label}" for n, _, label in parts if n)
    return f'<div class="mix" title="{_e(title)}">{spans}</div>'


def _module_row(m: ModuleRecord, dtype: str) -> str:
    name = m.path.rsplit(".", 1)[-1] if m.path else "<root>"
    badges = ""
    if m.own_local_overflow:
        badges += f'<span class="badge inf" title="{m.own_local_overflow} values overflow {dtype} in this module from finite inputs">overflows {m.own_local_overflow}</span>'
    elif m.local_overflow:
        badges += '<span class="badge inf" style="background:#fff;color:#d03b3b;border:1px solid #d03b3b" title="a submodule overflows">overflow inside</span>'
    elif m.overflow:
        badges += f'<span class="badge inf" style="opacity:.55" title="inf/nan arriving from upstream">inf {m.overflow}</span>'
    if m.kept_fp32:
        badges += f'<span class="badge kept" title="{_e(m.kept_fp32)}">fp32 kept</span>'
    bad = " bad" if m.overflow else ""
    tip = f"max rel error vs fp32 {_g(m.max_rel)}; min SQNR {_g(m.min_sqnr_db, '.1f')} dB; local error added {_g(m.local_error)}; casts to {dtype} {m.casts_to_low}, to fp32 {m.casts_to_fp32}"
    return (
        f'<div class="row" data-path="{_e(m.path)}" title="{_e(m.path or "<root>")}: {_e(tip)}">'
        f'<span class="name" style="padding-left:{14 * m.depth}px">{_e(name)}<span class="t">{_e(m.type)}</span>{badges}</span>'
        f'{_mix(m)}<span class="num">{m.ops_low}/{m.ops}</span>'
        f'<div class="bar{bad}"><i style="width:{100 * _bar_width(m.max_rel):.0f}%"></i></div>'
        f'<span class="num">{_g(m.max_rel)}</span></div>'
    )


def _tree(e: Explanation) -> str:
    children: dict[str, list[ModuleRecord]] = {}
    for m in e.modules:
        if m.path:
            parent = m.path.rsplit(".", 1)[0] if "." in m.path else ""
            children.setdefault(parent, []).append(m)

    def walk(m: ModuleRecord) -> str:
        kids = children.get(m.path, [])
        row = _module_row(m, e.dtype)
        if not kids:
            return row
        # Open the path to trouble and the top levels; fold the rest.
        opened = " open" if m.depth < 2 or m.overflow or m.kept_fp32 else ""
        return f"<details{opened}><summary>{row}</summary>{''.join(walk(k) for k in kids)}</details>"

    root = next(m for m in e.modules if not m.path)
    head = '<div class="row" style="font-weight:600;color:#6b7488"><span>module</span><span>precision</span><span class="num">low/ops</span><span>error vs fp32 (log)</span><span class="num">max rel</span></div>'
    return head + f'<div class="tree">{walk(root)}</div>'


def _ranking(e: Explanation) -> str:
    rows = "".join(
        f'<tr class="{"over" if m.own_local_overflow else ""}"><td>{_e(m.path)}</td><td>{_e(m.type)}</td><td class="n">{_g(m.own_local_error)}</td>'
        f'<td class="n">{m.own_local_overflow or ""}</td></tr>'
        for m in e.ranking()[:12] if m.own_local_error or m.own_local_overflow
    )
    return f"<table><thead><tr><th>module</th><th>type</th><th class=n>local error</th><th class=n>overflows</th></tr></thead><tbody>{rows}</tbody></table>"


def _dtype_chip(dtype: str | None, low: str) -> str:
    dtype = dtype.removeprefix("torch.").replace("int", "i").replace("float", "f") if dtype else dtype
    color = _LOW if dtype == low else _FP32 if dtype == "fp32" else _OTHER
    return f'<span class="dt" style="background:{color}">{_e(dtype or "–")}</span>'


def _node_rows(e: Explanation) -> str:
    first = e.first_nonfinite.name if e.first_nonfinite is not None else None
    out = []
    for i, n in enumerate(e.nodes):
        s = n.numerics
        cls = "first" if n.name == first else "over" if s is not None and s.overflow else ""
        cls += " other" if n.dtype not in (e.dtype, "fp32") else ""
        key = " ".join([n.name, n.op, n.module, n.module_type or "", n.dtype or "", n.reason, *n.input_casts]).lower()
        casts = "<br>".join(_e(c) for c in n.input_casts)
        flag = ' <span class="badge inf">first inf/nan</span>' if n.name == first else ""
        num = lambda v, fmt=".2g": f'<td class="n" data-v="{"" if v is None else v}">{_g(v, fmt)}</td>'
        out.append(
            f'<tr class="{cls}" data-k="{_e(key)}"><td class="n">{i}</td><td>{_e(n.name)}{flag}</td><td>{_e(n.op.removeprefix("aten.").removesuffix(".default"))}</td>'
            f'<td>{_e(n.module or "<root>")}</td><td>{_dtype_chip(n.dtype, e.dtype)}</td><td>{_e(n.reason)}<div class="casts">{casts}</div></td>'
            + (num(s.max_rel) + num(s.local_rel) + num(s.sqnr_db, ".1f") + num(s.overflow, "d") + num(s.underflow, "d") if s is not None else "<td></td>" * 5)
            + "</tr>"
        )
    return "".join(out)


def _grads(e: Explanation) -> str:
    if e.grads is None:
        return ""
    rows = "".join(
        f'<tr><td>{_e(g.name)}</td><td class="n">{g.numel}</td><td class="n">{g.underflow:.1%}</td><td class="n">{g.underflow_scaled:.1%}</td>'
        f'<td class="n">{g.nonfinite_scaled}</td><td class="n">{_g(g.max_rel)}</td></tr>'
        for g in sorted(e.grads, key=lambda g: -g.underflow)
    )
    return (
        '<section class="wide"><h2>Gradients: fraction of the fp32 gradient\'s nonzeros that are zero in low precision</h2>'
        "<table><thead><tr><th>parameter</th><th class=n>numel</th><th class=n>underflow, no scaling</th>"
        "<th class=n>with GradScaler's 65536</th><th class=n>inf/nan when scaled</th><th class=n>max rel (unscaled)</th></tr></thead>"
        f"<tbody>{rows}</tbody></table></section>"
    )


def render(e: Explanation) -> str:
    """The page for ``e``."""
    low = sum(n.dtype == e.dtype for n in e.nodes)
    fp32 = sum(n.dtype == "fp32" for n in e.nodes)
    banner = ""
    if e.numerics:
        f = e.first_nonfinite
        if f is not None:
            banner = (
                f'<div class="alert"><b>First inf/nan:</b> node <b>{_e(f.name)}</b> ({_e(f.op)}) in module '
                f'<b>{_e(f.module or "<root>")}</b> ({_e(f.module_type)}): {f.numerics.overflow} of {f.numerics.numel} '
                f"values overflow {_e(f.dtype)}. <i>{_e(f.reason)}</i></div>"
            )
        else:
            banner = f'<div class="okay">No node overflows {_e(e.dtype)}: every inf/nan count is 0.</div>'
        for o in e.outputs:
            bad = f'<b style="color:#d03b3b">{o.nonfinite} inf/nan</b>; on the finite values: ' if o.nonfinite else ""
            banner += (
                f'<div>output <code>{_e(o.path or "[0]")}</code> ({_e(o.dtype)}) vs the fp32 model: {bad}max abs {_g(o.max_abs)}, '
                f"max rel {_g(o.max_rel)}, SQNR {_g(o.sqnr_db, '.1f')} dB</div>"
            )
    kept = "".join(f"<div>kept in fp32: <b>{_e(p or '<root>')}</b> — {_e(w)}</div>" for p, w in e.kept_fp32)
    if e.plan:
        steps = "".join(f"<li>{_e(line)}</li>" for line in e.plan[1:])
        kept += f'<div class="plan"><b>{_e(e.plan[0])}</b><ul>{steps}</ul></div>'
    legend = (
        f'<div class="legend"><span><i class="sw" style="background:{_LOW}"></i>{_e(e.dtype)} ops</span>'
        f'<span><i class="sw" style="background:{_FP32}"></i>fp32 ops</span><span><i class="sw" style="background:{_OTHER}"></i>other</span>'
        '<span><i class="sw" style="background:#d03b3b"></i>overflow</span><span>double-click a module to filter the nodes</span></div>'
    )
    numeric_heads = "<th class=n>max rel</th><th class=n>local rel</th><th class=n>SQNR dB</th><th class=n>inf/nan</th><th class=n>to zero</th>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>graphamp explain: {_e(e.model)}</title><style>{_CSS}</style></head>
<body><header><h1>graphamp explain — {_e(e.model)} on {_e(e.device_type)}/{_e(e.dtype)}</h1>
<div class="sub">{len(e.nodes)} op nodes: {low} {_e(e.dtype)}, {fp32} fp32, {len(e.nodes) - low - fp32} other · {e.casts} casts · {_e(e.config)}</div></header>
<main>
<section class="wide">{banner}{kept}</section>
<section><h2>Modules, coloured by precision</h2>{legend}{_tree(e)}</section>
<section><h2>Modules whose own ops add the most error</h2>{_ranking(e)}</section>
<section class="table"><h2>Op nodes</h2><input type="search" id="q" placeholder="search op, module, dtype, reason…"> <label class="casts"><input type="checkbox" id="oth"> integer, bool and shape ops</label> <span id="cnt" class="casts"></span>
<table id="nodes"><thead><tr><th class=n>#</th><th>node</th><th>op</th><th>module</th><th>dtype</th><th>why (and casts on its inputs)</th>{numeric_heads if e.numerics else ""}</tr></thead>
<tbody>{_node_rows(e)}</tbody></table></section>
{_grads(e)}
</main><script>{_JS}</script></body></html>
"""
