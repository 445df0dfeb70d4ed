"""Quiet-machine micro-benchmark: prefill of the 16 suite chat prompts, one row at a time
(today: 512-token chunks per row) vs batched rows in one ragged forward."""
import statistics, sys, time
import mtplx
from mtplx import Engine
from mtplx.bench.suite import load_prompts
from mtplx.trunk.batch_cache import BatchCache
import mlx.core as mx

eng = Engine.load()
trunk = eng.trunk
prompts = load_prompts()
sys.path.insert(0, "benchmarks")
from serve_concurrency import chat_messages
toks = [eng.encode_prompt(chat_messages(p, str(i))) for i, p in enumerate(prompts)]
toks = [list(t) for t in toks]
print("lengths", sorted(len(t) for t in toks), "total", sum(len(t) for t in toks))

def one_by_one(chunk=512):
    for t in toks:
        cache = trunk.make_cache()
        pos, last = 0, len(t) - 1
        while pos < last:
            end = min(pos + chunk, last)
            out = trunk(mx.array(t[pos:end])[None], cache)
            mx.eval([c.state for c in cache])
            pos = end

def batched(group=8, chunk=512):
    order = sorted(range(len(toks)), key=lambda i: len(toks[i]))
    for g in range(0, len(order), group):
        rows = [toks[i][:-1] for i in order[g:g + group]]
        bc = BatchCache(trunk.make_cache(), trunk.model)
        bc.add_rows([trunk.make_cache() for _ in rows])
        pos = 0
        while any(pos < len(r) for r in rows):
            width = min(chunk, max(len(r) - pos for r in rows))
            block = [r[pos:pos + width] + [0] * (width - len(r[pos:pos + width])) for r in rows]
            blk = bc.begin_block(width)
            out = trunk(mx.array(block), bc.layers)
            mx.eval([c.state for c in bc.layers])
            bc.commit_block(blk, [max(0, min(width, len(r) - pos)) for r in rows])
            pos += width

for name, fn in [("one_by_one", one_by_one), ("batched8", batched), ("batched4", lambda: batched(4)), ("batched16x256", lambda: batched(16, 256))]:
    fn()  # warm
res = {k: [] for k in ["one_by_one", "batched8", "batched4", "batched16x256"]}
for rep in range(3):
    for name, fn in [("one_by_one", one_by_one), ("batched8", batched), ("batched4", lambda: batched(4)), ("batched16x256", lambda: batched(16, 256))]:
        t = time.perf_counter(); fn(); res[name].append(time.perf_counter() - t)
for k, v in res.items():
    print(k, [round(x, 2) for x in v], "median", round(statistics.median(v), 2))
