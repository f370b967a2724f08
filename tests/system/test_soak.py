"""Two minutes of tests/bench/soak.py's mixed load (HTTP and gRPC streams to the end and
cancelled, disconnects, bad requests, `simple` unloaded and loaded, the LLM reloaded, tiny
fine-tuning jobs) against kilnd serving SmolLM2; after a warm-up and then once idle, kilnd
holds no more descriptors or threads than at the start, every KV block is back in the pool,
and its resident memory grew by less than RSS_BOUND_MIB beyond the LoRA adapters the jobs
added (issue 13, item 7). `soak.py --minutes N` is the long version; the figures of the last
run are in build/tests/system/soak.json."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import soak  # noqa: E402  (tests/bench/soak.py)

MINUTES = 2
# glibc raises its mmap threshold after the first large free (up to 32 MiB), after which a
# reloaded model's buffers land in the heap: RSS then climbs by tens of MiB per reload for
# several reloads before it levels off (measured: +454 MiB over this test's 2 minutes, ~1.1
# GiB after 10 reloads, on a 540 MiB start), allocator caching, not a leak. A fixed threshold
# returns those buffers to the system on free, so what is left to grow is what kilnd keeps.
MMAP_THRESHOLD = 65536
# Measured with that threshold, 2 minutes, 6 workers: +25 MiB without fine-tuning (3 LLM
# reloads, 9 of `simple`, ~430 requests); with 2 fine-tuning jobs +110 MiB of which ~29 are
# the six adapters (each job serves its result and 2 checkpoints, 4.8 MiB each). The bound has
# about twice that headroom and still catches a model instance leaked per reload (~100 MiB
# each, 3 or more reloads) or the training state leaked per job (~75 MiB and up).
RSS_BOUND_MIB = 150
# Descriptors and threads: at the end as at the start (gRPC's pollers and the HTTP threads
# are warm by then); a couple of descriptors of slack for a timer or an accept in flight.
FD_SLACK = 2
THREAD_SLACK = 2


def test_two_minute_soak(tmp_path):
    k = soak.start_daemon(tmp_path, MMAP_THRESHOLD)
    lines = []
    try:
        report = soak.soak(k, MINUTES, log=lambda s: (lines.append(s), print(s)))
    except BaseException:
        k.stop()
        print(k.output()[-20000:])
        raise
    code = k.stop()
    log = "\n".join(lines)
    # pytest keeps a passing test's output to itself: the figures of the last run stay here.
    if os.environ.get("KILN_BUILD_DIR"):
        out = Path(os.environ["KILN_BUILD_DIR"]) / "tests" / "system" / "soak.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    start, end, delta = report["start"], report["end"], report["delta"]

    assert not report["unexpected"] and not report["warmup_unexpected"], log
    ran = report["requests"]
    for name, _, _ in soak.MIX:
        assert ran.get(name, 0) > 0, f"{name} never ran:\n{log}"
    assert ran.get("reload_llm", 0) >= 2 and ran.get("reload_simple", 0) >= 5, log
    assert ran.get("finetune_job", 0) >= 1, log

    assert end["kv_blocks_used"] == 0, log  # soak.settle waited for it through /metrics
    assert end["fds"] <= start["fds"] + FD_SLACK, f"descriptors grew:\n{log}"
    assert end["threads"] <= start["threads"] + THREAD_SLACK, f"threads grew:\n{log}"
    assert delta["rss_unexplained_mib"] < RSS_BOUND_MIB, f"resident memory grew:\n{log}"
    assert code == 0, f"kilnd exited with {code}:\n{k.output()[-20000:]}"
