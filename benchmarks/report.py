"""The benchmark page's tables, generated from ``benchmarks/results/*.json``: the only writer of its numbers.

    python benchmarks/report.py                 # prints the Markdown the docs site shows
    python benchmarks/report.py --check         # also fails if a results file is neither current nor archived
    python benchmarks/report.py --readme        # rewrites README.md's generated blocks (between their gen markers)

The docs build (``docs/hooks/generate.py``) calls :func:`render` for the ``<!-- gen:benchmarks -->`` marker
of ``docs/benchmarks.md``, so the page always shows what the JSON holds. Which files are current, and what
each compares, is :data:`SECTIONS`; the GPU runs' files (:data:`GPU_GLOB`) have their own table, last
(:func:`render_gpu`); superseded runs live in ``benchmarks/results/archive/`` and are not
shown. Each table lists every scalar field of the file's rows (runs of several rounds: the median rows,
with each round's ratio beside them), then the command, the machine, and the date the file was committed.
Values are shown as stored; floats with more than three decimals are rounded to three.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ARCHIVE = RESULTS / "archive"


@dataclass(frozen=True)
class Result:
    file: str
    """A JSON file in ``benchmarks/results/``, without ``.json``."""
    caption: str
    """What the run compares (no numbers: those come from the file)."""


@dataclass(frozen=True)
class Section:
    title: str
    text: str
    results: tuple[Result, ...]


SECTIONS: tuple[Section, ...] = (
    Section(
        "How large a model trains",
        "A ladder of GPT sizes, each size and system in a fresh process built on the meta device (DeepSpeed: "
        "under its `zero.Init` on NVMe), three optimizer steps at sequence 32, K=2, bf16-mixed, AdamW, on "
        "this machine's one disk; a system that fails at one size is not run at the larger ones. `gs_default` "
        "is `GreedySnakeStrategy()` as a user gets it (host budget: half the available memory; the end-of-fit "
        "hand-back planned within it); `gs_bf16_state` keeps Adam's state in bf16; `deepspeed` is ZeRO-Infinity "
        "with parameters and optimizer on NVMe, its buffers sized as its docs say. `status` says why a size "
        "did not train; `time_to_first_step_s` is model creation, setup (writing the initial state) and the "
        "first step; SSD bytes are the kernel's counters of the process.",
        (Result("scale", "The ladder, bf16-mixed, sequence 32, K=2."),
         Result("scale_lean", "The largest size `gs_bf16_state` trained, again with a small host budget "
                              "(`--host-budget-gb`, in the settings): how little RAM it needs."),
         Result("scale_rerun", "greedysnake's rows again, on later code (the commit is in `note`): the same sizes "
                               "train, at the same peak RSS."),
         Result("scale_default_5p5b", "The defaults at the ladder's largest size once the gradients' SSD file keeps "
                                      "only the deferred parts that wait there: the size the ladder refused them "
                                      "for disk trains."),
         Result("scale_ab_7cf8384", "Five steps at two sizes, the ladder's code against the later code, alternating: "
                                    "the steady step (`steady_step_s`, after the warm-step plan) the ladder's three "
                                    "steps do not show.")),
    ),
    Section(
        "The defaults and every kind on SSD against both DeepSpeed offloads",
        "GPT 1024 x 12 (168M parameters, vocabulary 8192), micro-batch 1, K=8, three rounds alternating the "
        "systems in fresh processes. Each greedysnake run is set against the peer that keeps its state where "
        "it does: `gs_default` (`GreedySnakeStrategy()`; on this machine the plan keeps every kind in RAM) "
        "against DeepSpeed ZeRO-3 with parameters and optimizer offloaded to CPU memory (`deepspeed_cpu`, "
        "ZeRO-Offload) and against Lightning in memory (`lightning_auto`); `gs_vertical` (every kind on SSD, "
        "`auto=False`) against DeepSpeed ZeRO-Infinity with parameters and optimizer on NVMe (`deepspeed`). "
        "`vs_deepspeed_cpu` and `vs_deepspeed` are tokens/s ratios.",
        (Result("compare_issue37_seq128_bf16", "Sequence 128, bf16-mixed."),
         Result("compare_issue37_seq32_bf16", "Sequence 32, bf16-mixed."),
         Result("compare_issue37_seq128_fp32", "Sequence 128, 32-true."),
         Result("compare_issue37_seq32_fp32", "Sequence 32, 32-true.")),
    ),
    Section(
        "The defaults with the planned order, against Lightning and ZeRO-Offload",
        "The same model and settings as above, on the tree where setup plans the schedule and the warm-step plan "
        "counts the cores the optimizer lane shares with the training: with every kind in RAM on this CPU "
        "machine `gs_default` runs the horizontal order (one micro-batch's activations alive, as in Lightning) "
        "and steps each unit in line (`lag` 0, on both cores); the runs above, on 7cf8384, ran the vertical "
        "order with K=8 micro-batches' graphs and a background step on one core. Sequence 128 on 750aae0 "
        "(a RAM run no longer trims the heap after each unit's step), sequence 32 on c11479e (before that). "
        "Against DeepSpeed ZeRO-3 with parameters and optimizer in CPU memory (`deepspeed_cpu`) and Lightning "
        "in memory (`lightning_auto`), three rounds alternating in fresh processes.",
        (Result("compare_ram_seq128_bf16", "Sequence 128, bf16-mixed."),
         Result("compare_ram_seq32_bf16", "Sequence 32, bf16-mixed."),
         Result("compare_ram_seq128_fp32", "Sequence 128, 32-true."),
         Result("compare_ram_seq32_fp32", "Sequence 32, 32-true.")),
    ),
    Section(
        "Sequence 128, 32-true, in a rotated order on a settled machine",
        "The configuration where the defaults trailed Lightning above, rerun with every system in "
        "every slot: each round starts one system later, and before each fresh process the kernel writes back "
        "what the last one left dirty (DeepSpeed's swap files). `gs_default` (every kind in RAM, horizontal "
        "order, in-line steps) against Lightning in memory and ZeRO-Offload; `gs_vertical` (every kind on SSD) "
        "against ZeRO-Infinity. In round 0 gs_default took the first slot, right after the machine probe, and "
        "ran slow there (as in two other runs that day).",
        (Result("compare_rotated_seq128_fp32", "GPT 1024 x 12, sequence 128, K=8, 32-true, three rounds."),
         Result("compare_rerun_seq128_fp32", "The defaults and Lightning again, half an hour later on the same "
                                             "machine, two rounds: Lightning ran faster than in any earlier run that "
                                             "day, the defaults did not, so the gap at 32-true is not closed."),
         Result("compare_steady_seq128_fp32", "The defaults and Lightning on 61b5aa0, six steps a run (steps 3 to 6 "
                                              "timed, alike for both), three rounds: the defaults' first step after "
                                              "the warm-step plan faults the heap in again and runs slow; with the "
                                              "steps after it timed too they keep Lightning's pace."),
         Result("compare_steady_seq128_fp32_after_backward", "The same on 33b396d, where the synchronous steps "
                                                             "of the defaults run once the window's backward is "
                                                             "done: still within 5% of Lightning in every round.")),
    ),
    Section(
        "Every configuration in the rotated order",
        "The four configurations of the DeepSpeed comparison above (sequence 128 and 32, bf16-mixed and 32-true, "
        "K=8, GPT 1024 x 12), each rerun on c10bf96 in compare.py's rotated order with the kernel settled before "
        "each fresh process, one command after the other on a quiet machine. `gs_default` against Lightning in "
        "memory (`vs_lightning_auto`) and ZeRO-Offload (`vs_deepspeed_cpu`); `gs_vertical` against "
        "ZeRO-Infinity (`vs_deepspeed`).",
        (Result("compare_rotated_seq128_bf16", "Sequence 128, bf16-mixed."),
         Result("compare_rotated_seq32_bf16", "Sequence 32, bf16-mixed."),
         Result("compare_rotated_again_seq128_fp32", "Sequence 128, 32-true (the configuration of the section "
                                                     "above, again)."),
         Result("compare_rotated_seq32_fp32", "Sequence 32, 32-true.")),
    ),
    Section(
        "Planned SSD runs since the planner counts shared cores",
        "Every kind on SSD, planned (`gs_auto_ssd`) and `auto=False` (`gs_vertical`), this tree against c2872eb, "
        "the commit before the warm-step plan counted the cores a background optimizer step shares with the "
        "training on a CPU run; bf16-mixed, GPT 1024 x 12, sequence 32, K=8, two rounds alternating.",
        (Result("compare_shared_cores_ssd_seq32", "`vs_baseline`: tokens/s against c2872eb."),
         Result("compare_writebehind_seq32", "`gs_vertical` on 30446f5 against b29bf93, 32-true, three rounds "
                                             "alternating: prefetches that wait for a finished step's write-behind, "
                                             "instead of being refused, cost no speed."),
         Result("compare_io_consolidation_seq32", "`gs_vertical` on 4afcf51 against 6d4235d, bf16-mixed, three "
                                                  "rounds alternating: the I/O engine's chunks counted down by "
                                                  "`io.when_all`, at no cost.")),
    ),
    Section(
        "SSD against SSD",
        "Every kind on SSD for both systems. `gs_vertical` is `auto=False` (ZeRO-Infinity's placement, the fixed "
        "alpha, lag, recompute and the automatic staging budget); `gs_auto` plans the rest over the same "
        "placement; `lightning_auto` is Lightning's default strategy in memory, for reference. "
        "`fraction_of_roofline` here is the planner's roofline (its compute measured inside the SSD run) over the "
        "measured step; from `compare_issue54_v2` on, `compare.py` writes the physical limit there instead.",
        (Result("compare_seq128_v3", "Sequence 128, K=8, bf16-mixed."),
         Result("compare_seq32_v3", "Sequence 32, K=8, where a micro-batch's weight traffic outweighs its "
                                    "compute.")),
    ),
    Section(
        "Vertical against horizontal over K",
        "The same engine in the two orders, every kind on SSD, sequence 32: the vertical order loads each "
        "unit's weights twice a step whatever K, the horizontal order 2K times.",
        (Result("compare_seq32_sweep_v2", "Tokens/s per K, both orders."),
         Result("roofline", "Measured step against the roofline (the largest of compute, SSD bytes over the "
                            "measured bandwidth, optimizer elements over the measured rate), GPT 1024 x 4, "
                            "32-true.")),
    ),
    Section(
        "A host budget",
        "The planner within an explicit host budget (`--host-budget-gb`) against the `greedysnake_cpu` preset "
        "(everything in RAM); `time_vs_cpu` is the step time ratio.",
        (Result("compare_auto", "GPT 1024 x 12, sequence 128, K=8, bf16-mixed."),),
    ),
    Section(
        "Memory",
        "Peak resident memory against the model state (16 bytes per parameter), each placement in a fresh "
        "process; growth is peak RSS over the same process idle.",
        (Result("memory", "GPT 1024 x 20 (270M parameters), sequence 128, K=4."),
         Result("memory_defaults_bf16", "GreedySnakeStrategy() as it is on 750aae0 (the planner kept every kind in "
                                        "RAM and so ran the horizontal order, stepping in line, the heap left to the "
                                        "allocator; return_weights=True) against Lightning in memory, "
                                        "GPT 1024 x 12 (168M parameters), bf16-mixed, sequence 128, K=8, 4 steps "
                                        "(past the warm-step plan after step 2: an earlier 2-step measurement saw only "
                                        "the first steps' recompute and missed the vertical order's K graphs); "
                                        "train_peak_rss_mb is the peak by the last step, peak_rss_mb includes the end "
                                        "of fit."),
         Result("memory_defaults_fp32", "The same at 32-true: GreedySnakeStrategy() as it is against Lightning in "
                                        "memory, GPT 1024 x 12, sequence 128, K=8, 4 steps. (On c11479e, which "
                                        "still trimmed the heap after every unit's step, the same command gave "
                                        "3,273 MB against Lightning's 3,231 MB.)"),
         Result("memory_defaults_fp32_12steps", "The same at 12 steps, two rounds alternating (c10bf96): by "
                                                "peak_rss_by_step_mb both runs' peaks stop growing within the first "
                                                "steps; a longer run does not creep."),
         Result("memory_defaults_fp32_trim", "The same at 8 steps, two rounds alternating, with the heap trimmed "
                                             "once when the warm-step plan reconfigures the store: the peak is "
                                             "reached by step 2 (the steps before the plan) and holds."),
         Result("memory_defaults_fp32_first_step_trim", "The same on c111378, the heap also trimmed once after the "
                                                        "optimizer's first step: step 2 no longer sets the peak; the "
                                                        "steps after the plan creep up to it."),
         Result("memory_defaults_bf16_steps_after_backward", "The defaults and Lightning under bf16-mixed on "
                                                             "6271448, 6 steps, two rounds alternating: the "
                                                             "defaults' peak below Lightning's in both."),
         Result("memory_defaults_fp32_steps_after_backward", "The same on 33b396d, three rounds: at lag 0 a unit's "
                                                             "step that stages nothing runs once the window's "
                                                             "backward is done, as Lightning steps, so its "
                                                             "temporaries no longer stack on the backward's; the "
                                                             "defaults' median peak is level with Lightning's."),
         Result("memory_budget_bf16", "The end of fit within a 2 GiB host budget (auto_host_budget_bytes), GPT "
                                      "1024 x 12, bf16-mixed, sequence 128, K=8, 2 steps: the weights come back, the "
                                      "optimizer's state (said at setup) does not; @afcc0d0 copied everything back."),
         Result("litgpt_1b", "LitGPT's 1B Llama config (its untied head counted in params) built on the meta device, "
                             "every kind on SSD (auto=False), return_weights=False, 32-true, sequence 256, K=4: "
                             "each optimizer step's seconds and its own SSD bytes.")),
    ),
    Section(
        "The overlapped optimizer",
        "Synchronous steps against the background lane (`lag`) and the deferred share (`alpha`), state on SSD; "
        "`optimizer_unhidden_s` is optimizer time not hidden behind compute.",
        (Result("overlap", "GPT 1024 x 4, sequence 128, K=8, 32-true."),),
    ),
    Section(
        "Optimizer state formats",
        "Optimizer state in bf16 (`offload.optimizer_state_dtype=bfloat16`) and torchao's 8-bit AdamW against "
        "fp32 state, alternating in one run, GPT 1024 x 12, every kind on SSD, `auto=False` unless the "
        "system says `auto`. The state's bytes shrink; whether the step does depends on what binds.",
        (Result("compare_bf16_state", "Sequence 128, K=8, bf16-mixed."),
         Result("compare_bf16_state_seq32", "Sequence 32, K=8."),
         Result("compare_bf16_state_seq8", "Sequence 8, K=8."),
         Result("compare_bf16_state_seq32_k2", "Sequence 32, K=2: the disk binds."),
         Result("compare_bf16_state_auto_ssd_seq32_k2", "Sequence 32, K=2, the planned settings over an all-SSD "
                                                        "placement."),
         Result("compare_bf16_state_fp32", "Sequence 128, K=8, 32-true."),
         Result("compare_8bit_state", "torchao's `AdamW8bit`, sequence 128, K=8, bf16-mixed."),
         Result("state_dtype", "Convergence: the example's GPT, 500 steps, every kind on SSD (`auto=false`)."),
         Result("optimizer_rate", "Host optimizer rate (elements per second) on this machine's CPU.")),
    ),
    Section(
        "Checkpoints",
        "One save, a second save at the same step (as `save_last` does) and a resume, against Lightning's "
        "default in-memory checkpoint.",
        (Result("checkpoint", "GPT 1024 x 12, bf16-mixed."),),
    ),
    Section(
        "Data parallel",
        "Two processes with one thread each against one with two; collective bytes are each rank's payload per "
        "optimizer step.",
        (Result("distributed", "GPT 512 x 4, sequence 64, bf16-mixed, state on SSD."),),
    ),
    Section(
        "Unit size and the disk",
        "Setup's choice of `layers_per_unit` against every fixed size, every kind on SSD; and how one disk "
        "serves a read stream beside a write stream (the planner sums them).",
        (Result("unit_size_1024x12", "GPT 1024 x 12, sequence 128, K=8, 32-true, two rounds."),
         Result("unit_size_512x8", "GPT 512 x 8, sequence 32, K=8, 32-true, two rounds: a small model on a CPU, "
                                   "where larger units pay the engine's per-op cost fewer times."),
         Result("unit_size_1024x12_seq32_bf16", "GPT 1024 x 12, sequence 32, K=8, bf16-mixed, every kind on "
                                                "SSD, three rounds (54c166d): `compare.py`'s model and settings, "
                                                "where the two cores bind; the planned size beside one and eight "
                                                "blocks a unit."),
         Result("disk_mix", "A read stream beside a write stream, against the two in turn.")),
    ),
    Section(
        "Changes measured against their baseline",
        "Runs of the same system on this code and on an earlier commit (`system@commit`), alternating; "
        "`vs_baseline` is the tokens/s ratio.",
        (Result("refactor_seq128", "The tensor manager's rebuild around explicit ownership."),
         Result("compare_readahead_seq32_k2", "Reading each step's state ahead, where the disk binds."),
         Result("compare_issue33", "Issue 33's consolidation, 750aae0 against 0170bae (before it began); "
                                   "`gs_default` also has the planned horizontal order and in-line step here."),
         Result("compare_issue52_seq32", "Issue 52 (the optimizer step owned by the strategy, the optimizer "
                                         "contract, the estimate of stepping batches) at 6f69ce3 "
                                         "against 07d2d42 (before it), bf16-mixed, sequence 32, three rounds "
                                         "alternating."),
         Result("compare_issue54_seq32", "Issue 54, every kind on SSD (`gs_vertical`) against every kind in RAM "
                                         "(`gs_default`), 7ad16c8 (every coming step's reads started as far "
                                         "ahead as the staging slack allows) against 1851e7d (one step ahead; "
                                         "both with the per-step breakdown), bf16-mixed, sequence 32, two rounds "
                                         "alternating: `vs_limit` is the step over the largest physical term "
                                         "(`binds`: the same round's `gs_default` step, the I/O counters' bytes "
                                         "at the probed speeds, every element at the optimizer's kernel rate); "
                                         "the disk's busy fraction and bandwidth while busy, the queue depth, the "
                                         "lane's CPU seconds apart from its waits on reads."),
         Result("compare_issue54_v2_seq32", "Issue 54 after the double-buffered staging of `auto=False` and the "
                                            "deferred parts read on the lane (5415b48, 6641462), at 418287b "
                                            "against df7c63f, bf16-mixed, sequence 32, three rounds alternating, "
                                            "with `lightning_auto`: `vs_limit` and `roofline_s` are the physical "
                                            "terms only (the same round's `gs_default` step, the I/O counters' "
                                            "bytes at the probed speeds, the optimizer's kernel rate)."),
         Result("compare_issue54_v2_seq128", "The same at sequence 128, 418287b, three rounds alternating (no "
                                             "baseline tree: the session's time)."),
         Result("compare_issue54_v4_seq32", "Issue 54 after the warm-step plan took each unit's compute as its "
                                            "fastest micro-batch (9be6a90) and a deferred part's gradient read "
                                            "went out with its own (fe0c31e), against 48a0697, bf16-mixed, "
                                            "sequence 32, three rounds alternating, the disk probed before each "
                                            "round: `gs_auto_ssd` is the defaults with every kind on SSD (the "
                                            "plan's alpha, lag and recompute), `gs_vertical_ram` the fixed "
                                            "settings of `gs_vertical` with every kind in RAM (`vs_same_in_ram`, "
                                            "`lane_cpu_vs_ram`: the same schedule and lane without the disk)."),
         Result("compare_issue54_v4_seq128", "The same at sequence 128, 9be6a90, three rounds alternating (no "
                                             "baseline tree: the session's time)."),
         Result("compare_issue56_s20_seq32", "Issue 56's speed check: the whole-unit access object, the plan "
                                             "applied once and the saved-activations rename (5bad422 with the "
                                             "tree as measured) against c8abbd6, bf16-mixed, sequence 32, K=8, "
                                             "three rounds alternating on a noisy disk."),
         Result("compare_issue56_s20_seq32_rerun", "The same, run again at once, on a machine noisier still "
                                                   "(compare the two runs' `gs_default` rows)."),
         Result("compare_issue54_thp_seq128", "Issue 54: host buffers of 2 MiB or more advised transparent huge "
                                              "pages (b3771a5) against the tree before (078409b), bf16-mixed, "
                                              "sequence 128, K=8, three rounds alternating: `read_GBps_busy` and "
                                              "`write_GBps_busy` are the disk's bandwidth while busy (each O_DIRECT "
                                              "request pins and maps 2 MiB pages instead of 4 KiB ones); "
                                              "`vs_same_in_ram` the step against the same fixed settings in RAM."),
         Result("compare_issue54_thp_seq32", "The same at sequence 32 (the disk binds), with `gs_default`, the "
                                             "compute term of `vs_limit`."),
         Result("compare_issue54_limit_seq128", "Issue 54's target at sequence 128 as the issue states it: "
                                                "every kind on SSD (`gs_vertical`) against max(the same round's "
                                                "`gs_default` step, the disk's time at the probed speeds) in "
                                                "`vs_limit`, with Lightning in RAM beside them, 913499f, "
                                                "bf16-mixed, K=8, three rounds alternating (no baseline tree)."),
         Result("compare_issue54_diskbound_seq8_k2", "Issue 54's limit where the disk binds, as on a GPU (the "
                                                     "compute a fraction of the disk's time: sequence 8, K=2): "
                                                     "`gs_vertical` against max(`gs_default`, the disk at the "
                                                     "round's probed speeds), with the forward phase's and the "
                                                     "rest's disk busy fractions, c8d41b9, bf16-mixed, three "
                                                     "rounds."),
         Result("compare_issue54_io_cost_seq32", "What the disk's traffic alone costs the computation, against "
                                                 "what the SSD path costs (598d08d, bf16-mixed, sequence 32, K=8, "
                                                 "three rounds): `gs_vertical_ram_io` is the same fixed settings "
                                                 "in RAM while another process keeps the disk busy "
                                                 "(`vs_same_in_ram`), `gs_vertical`'s `vs_ram_beside_disk` its "
                                                 "step against that; the forward phase apart."),
         Result("compare_issue54_io_cost_seq128", "The same at sequence 128."),
         Result("compare_issue54_planned_ssd_seq32", "Issue 54's option (b), the planned defaults with every kind "
                                                     "on SSD (`gs_auto_ssd`, which plans recompute as "
                                                     "`gs_default` does) against max(`gs_default`, the disk), "
                                                     "4067d53, bf16-mixed, sequence 32, K=8, three rounds."),
         Result("compare_issue54_fast_disk_seq32", "Issue 54 on a faster disk (the probe is in the machine "
                                                   "record), 8be93fe, bf16-mixed, sequence 32, K=8, three rounds "
                                                   "(written to /tmp and copied here): the disk about half busy, "
                                                   "the step bound by the two cores; `gs_auto_ssd`'s unit size, "
                                                   "planned at setup from the disk alone, differs between rounds "
                                                   "(its `plan` field), and so does its step."),
         Result("compare_issue54_arena_seq32", "The staging pool's one mapped arena without a device tier "
                                               "(a07cbbc) against the cache by exact size before it (6fbdbca), "
                                               "bf16-mixed, sequence 32, K=8, three rounds alternating: "
                                               "`vs_baseline` is the speed-up; `gs_auto_ssd` planned eight "
                                               "blocks a unit in every run, where the old cache seldom missed."),
         Result("compare_issue54_after_arena_seq32", "Issue 54's three readings after the one arena (286362c), "
                                                     "bf16-mixed, sequence 32, K=8, three rounds: `gs_vertical` "
                                                     "against max(`gs_default`, the disk) (`vs_limit`, as the "
                                                     "issue states it) and against the same fixed settings in "
                                                     "RAM (`vs_same_in_ram`); the planned defaults on SSD "
                                                     "(`gs_auto_ssd`) against max(`gs_default`, the disk)."),
         Result("compare_issue54_after_arena_seq128", "The same at sequence 128."),
         Result("compare_issue56_final_seq32", "Issue 56's speed check over the whole issue: bead1a1 (one "
                                               "setup placement per unit size, after the commits of the issue "
                                               "and the race fix) against 6233209, the commit before the "
                                               "issue's first, bf16-mixed, sequence 32, K=8, three rounds "
                                               "alternating, on a machine slower and noisier than the runs "
                                               "above (compare the `gs_default` rows). The tree measured also "
                                               "holds issue 54's huge pages (b3771a5), which the "
                                               "`gs_vertical` rows include."),
         Result("compare_issue56_setup_plan_seq32", "Issue 56 item 7's speed check: setup's plan in one call "
                                                    "(604d852) against the commit before it (09fcbef), "
                                                    "bf16-mixed, sequence 32, K=8, three rounds alternating: "
                                                    "`vs_baseline` is the speed-up (the change is setup's; the "
                                                    "steps run the same plan)."),
         Result("compare_issue56_cuts_seq32", "Issue 56's speed check of its line cuts (e48cd66..734db7a: "
                                              "the pool's non-blocking wait, the region sizes, the I/O "
                                              "counters, the stepper's pass-throughs) against the commit "
                                              "before them (5b08c33), bf16-mixed, sequence 32, K=8, three "
                                              "rounds alternating; `gs_vertical` is rerun in "
                                              "`compare_issue56_cuts_vertical_rerun_seq32`."),
         Result("compare_issue56_cuts_vertical_rerun_seq32", "`gs_vertical` of `compare_issue56_cuts_seq32` "
                                                             "again, five rounds alternating, the same "
                                                             "trees and settings (its three rounds spread "
                                                             "wider than the change could explain)."),
         Result("compare_whole_parameter_seq32", "AdamW on whole parameters (`gs_vertical_whole`, "
                                                 "`optimizer_path=\"whole_parameter\"`, the path of Adafactor and "
                                                 "Muon) against the element-wise path (`gs_vertical`), every kind "
                                                 "on SSD, bf16-mixed, sequence 32, three rounds alternating: "
                                                 "`time_vs_vertical` and `bytes_vs_vertical` (every parameter "
                                                 "starts on a 2048-element boundary there)."),
         Result("compare_planned_schedule", "The schedule planned at setup (horizontal with every kind in RAM) "
                                            "and the lag planned for shared cores (in line: 0), 750aae0, against "
                                            "the tree before both (4a3865c: the vertical order, a background step)."),
         Result("unit_size_relayout_disk", "Moving the state into larger units mid-run (the warm-step plan's "
                                           "relayout), measured side by side before it was removed: the run "
                                           "keeps the unit size it started with.")),
    ),
    Section(
        "LoRA: a frozen base",
        "LitGPT's LoRA model (`litgpt.lora.GPT`, `mark_only_lora_as_trainable`): the base frozen, read-only under "
        "greedysnake (read with its unit, never written, no gradient or optimizer state), the adapters trained "
        "with AdamW. What a checkpoint of such a run costs: Lightning's full checkpoint (the unchanged base "
        "with every save) against the adapters alone (LitGPT's `lit_model.pth.lora`), each save's seconds and "
        "bytes.",
        (Result("lora", "A bf16 base of 3 GB (24 layers at the width of Llama's 1B model), LoRA r=16 on query "
                        "and value, K=8, sequence 128, bf16-mixed, host budget 1 GiB: greedysnake with the base on "
                        "SSD against DeepSpeed ZeRO-Infinity (parameters and optimizer on NVMe) and the limit "
                        "(`limit`: the same window computed with the base resident, no I/O)."),
         Result("lora_checkpoint", "A full checkpoint against the adapters only, fp32, every kind on SSD under "
                                   "greedysnake, medians of three saves.")),
    ),
)

_HIDDEN = {"package", "runs", "seq", "round", "units", "plan", "placement", "first_step_note", "log_tail"}
"""Row fields not shown as columns (the run's own bookkeeping, or nested)."""


def current_files() -> list[str]:
    return [r.file for s in SECTIONS for r in s.results]


def plots() -> list[Path]:
    """The plots the page shows (a PNG beside a current JSON file)."""
    return [p for p in (RESULTS / f"{name}.png" for name in current_files()) if p.exists()]


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def cell(value: Any) -> str:
    """A value as the table shows it: as stored; a float with more than three decimals rounded to three."""
    if isinstance(value, float):
        text = repr(value)
        if "." in text and "e" not in text and len(text.split(".")[1]) > 3:
            return f"{value:.3f}"
        return text
    if isinstance(value, list):
        return ", ".join(cell(v) for v in value)
    return str(value)


def _shown_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """The rows a table shows and, for runs of several rounds, each median row's per-round ratios."""
    medians = [r for r in rows if r.get("round") == "median" and "system" in r]
    if not medians:
        return rows, {}
    ratio_keys = [k for k in medians[0] if k.startswith(("vs_", "time_vs_", "bytes_vs_"))] or [
        k for r in medians for k in r if k.startswith(("vs_", "time_vs_"))]
    rounds: dict[str, list[Any]] = {}
    for m in medians:
        key = next((k for k in ratio_keys if k in m), None)
        if key is None:
            continue
        per_round = [r.get(key) for r in rows if r.get("round") != "median" and r.get("system") == m.get("system")
                     and r.get("k") == m.get("k")]
        rounds[m["system"]] = [v for v in per_round if v is not None]
    return medians, rounds


def table(rows: list[dict[str, Any]]) -> str:
    shown, rounds = _shown_rows(rows)
    hidden = _HIDDEN if shown is not rows else _HIDDEN - {"round"}
    columns: list[str] = []
    for r in shown:
        for k, v in r.items():
            if k not in hidden and k not in columns and not isinstance(v, dict):
                columns.append(k)
    if rounds:
        columns.append("per round")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in shown:
        cells = []
        for c in columns:
            if c == "per round":
                cells.append(cell(rounds.get(r.get("system"), [])))
            else:
                cells.append(cell(r[c]) if c in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def committed(path: Path) -> str:
    """The date the file was last committed (git), or 'not committed'."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%cs", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or "not committed"


def machine(data: dict[str, Any]) -> str:
    m = data.get("machine", {})
    parts = [f"{m['cpus']} CPUs" if "cpus" in m else "", m.get("platform", ""), f"Python {m['python']}" if
             "python" in m else ""]
    if "read_GBps" in m:
        parts.append(f"disk probe read {cell(m['read_GBps'])} GB/s, write {cell(m['write_GBps'])} GB/s")
    if "optimizer_Melem_per_s" in m:
        parts.append(f"optimizer {cell(m['optimizer_Melem_per_s'])} M elements/s")
    return "; ".join(p for p in parts if p)


def render_result(result: Result) -> str:
    data = load(result.file)
    path = RESULTS / f"{result.file}.json"
    out = [f"**{result.caption}**", "", table(data["rows"]), ""]
    settings = data.get("settings") or data.get("model")
    if settings:
        out.append("*Settings*: " + ", ".join(f"{k} {cell(v)}" for k, v in settings.items()) + "  ")
    out += [f"*Command*: `{data.get('command', '(not recorded)')}`  ",
            f"*Machine*: {machine(data)}  ",
            f"*Date*: {committed(path)} · *File*: `benchmarks/results/{result.file}.json`", ""]
    if (RESULTS / f"{result.file}.png").exists():
        out += [f"![{result.file}](img/benchmarks/{result.file}.png)", ""]
    return "\n".join(out)


def render() -> str:
    out = []
    for section in SECTIONS:
        out += [f"## {section.title}", "", section.text, ""]
        out += [render_result(r) for r in section.results]
    out.append(render_gpu())
    return "\n".join(out)


# ---- the GPU runs (benchmarks/gpu_session.sh on a lent H100 or H200) ----

GPU_GLOB = "gpu_*.json"
"""The GPU runs' files in ``benchmarks/results/``: each a copy of a GPU session's ``$OUT/gpu.json``
(``benchmarks/gpu.py summary`` writes it), named for the card, e.g. ``gpu_h100.json``, ``gpu_h200.json``."""

GPU_COLUMNS = {
    "config": "system", "k": "K", "step_s": "step s", "tokens_per_s": "tokens/s", "TFLOPs": "TFLOP/s",
    "mfu": "MFU (measured peak)", "mfu_datasheet": "MFU (datasheet)", "peak_rss_gb": "peak RSS GiB",
    "ssd_GB_per_step": "SSD GB/step", "pcie_GB_per_step": "PCIe GB/step", "binds": "binds",
    "of_roofline": "of roofline", "vs_in_memory": "vs in memory", "gpu_idle": "GPU idle",
    "vs_deepspeed": "vs ZeRO-Infinity", "error": "error",
}
"""The GPU table's columns (a row's field: its heading)."""

GPU_TEXT = (
    "One GPU (an H100 or an H200), `bash benchmarks/gpu_session.sh`: GPT 1024 x 8 (vocabulary 16384), sequence "
    "1024, micro-batch 4, bf16-mixed, each system in a fresh process, the steps after the warm-step plan timed. "
    "`lightning` is Lightning in memory; `default` is `GreedySnakeStrategy()` with its state forced off the GPU; "
    "`horizontal` the same in ZeRO-Infinity's order; `resident_weights` keeps the compute weights on the GPU and "
    "everything else on SSD; `vertical_ssd` and `horizontal_ssd` keep every kind on SSD; `deepspeed` is "
    "ZeRO-Infinity with parameters and optimizer on NVMe. MFU is model TFLOP/s (no recomputation) over the "
    "measured bf16 matmul rate and over the datasheet's dense bf16 peak. `of roofline` is the largest physical "
    "term over the step: compute (Lightning in memory at the same K, with recomputation where the system "
    "recomputes), the SSD bytes (the kernel's counters) at the probed O_DIRECT speeds, the PCIe bytes at the "
    "measured pinned bandwidth, the host AdamW rate over every element; `binds` names it.")


def gpu_files() -> list[Path]:
    return sorted(RESULTS.glob(GPU_GLOB))


def gpu_table(data: dict[str, Any]) -> str:
    """A GPU run's rows (``gpu.json``) as the GPU table: :data:`GPU_COLUMNS`, those any row has."""
    rows = [r for r in data["rows"] if r.get("config") != "deepspeed_build"]
    columns = [c for c in GPU_COLUMNS if any(c in r for r in rows)]
    lines = ["| " + " | ".join(GPU_COLUMNS[c] for c in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r[c]) if c in r else "-" for c in columns) + " |")
    return "\n".join(lines)


def gpu_machine(data: dict[str, Any]) -> str:
    """The card and the rates a GPU run measured (its ``machine.json``)."""
    m = data.get("machine", {})
    parts = [m.get("gpu", "no GPU (a dry run)"), f"{m['cpus']} CPUs" if "cpus" in m else "",
             f"torch {m['torch']}" if "torch" in m else ""]
    if m.get("datasheet_flops"):
        parts.append(f"datasheet bf16 {m['datasheet_flops'] / 1e12:.0f} TFLOP/s")
    if m.get("peak_flops"):
        parts.append(f"measured matmul {m['peak_flops'] / 1e12:.0f} TFLOP/s")
    if m.get("pcie_bps"):
        parts.append(f"pinned copies {m['pcie_bps'] / 1e9:.1f} GB/s")
    if m.get("read_bps"):
        parts.append(f"disk probe read {m['read_bps'] / 1e9:.2f} GB/s, write {m['write_bps'] / 1e9:.2f} GB/s")
    if m.get("opt_rate"):
        parts.append(f"host AdamW {m['opt_rate'] / 1e6:.0f} M elements/s")
    return "; ".join(p for p in parts if p)


def render_gpu_result(path: Path) -> str:
    data = json.loads(path.read_text())
    out = [f"**{path.stem}**", "", gpu_table(data), ""]
    if data.get("settings"):
        out.append("*Settings*: " + ", ".join(f"{k} {cell(v)}" for k, v in data["settings"].items()) + "  ")
    out += [f"*Command*: `{data.get('command', '(not recorded)')}`  ", f"*Machine*: {gpu_machine(data)}  ",
            f"*Date*: {committed(path)} · *File*: `benchmarks/results/{path.name}`", ""]
    return "\n".join(out)


def render_gpu() -> str:
    """The GPU section: each GPU run's table, or the line that says none has run yet."""
    files = gpu_files()
    out = ["## On a GPU", "", GPU_TEXT, ""]
    if not files:
        out += ["No GPU run yet: a session lent a GPU runs `bash benchmarks/gpu_session.sh` (see "
                "[On a GPU](how-to/gpu.md)) and commits its `gpu.json` as `benchmarks/results/gpu_<card>.json`.", ""]
    out += [render_gpu_result(f) for f in files]
    return "\n".join(out)


HEADLINE = Result("compare_rotated_seq128_fp32",
                  "GPT 1024 x 12 (168M parameters), sequence 128, K=8, 32-true, 2-core CPU, the median of three "
                  "rounds in a rotated order")
"""The README's one table: greedysnake's defaults and every kind on SSD, each against the DeepSpeed offload
that keeps its state where it does, with Lightning in memory."""

HEADLINE_SYSTEMS = {
    "gs_default": ("greedysnake, `GreedySnakeStrategy()` (planned: here every kind in RAM)", "deepspeed_cpu"),
    "lightning_auto": ("Lightning `strategy=\"auto\"`, everything in RAM", "deepspeed_cpu"),
    "deepspeed_cpu": ("DeepSpeed ZeRO-Offload, parameters and optimizer in CPU memory", "deepspeed_cpu"),
    "gs_vertical": ("greedysnake, every kind on SSD, `auto=False`", "deepspeed"),
    "deepspeed": ("DeepSpeed ZeRO-Infinity, parameters and optimizer on NVMe", "deepspeed"),
}
"""Per system: its label and the peer its ratio is taken against."""
PEERS = {"deepspeed_cpu": "ZeRO-Offload", "deepspeed": "ZeRO-Infinity"}
SCALE = (Result("scale", "The ladder: bf16-mixed, sequence 32, K=2, three optimizer steps"),
         Result("scale_lean", "The largest size again with a small host budget (`--host-budget-gb`)"),
         Result("scale_default_5p5b", "The defaults at the size the ladder refused them, on later code"))
"""The README's size table: the largest GPT each system trained on this machine."""


def headline() -> str:
    """The README's headline table (and plot, where the file has one), from :data:`HEADLINE`'s file only: the
    median rows of a run of several rounds."""
    data = load(HEADLINE.file)
    rows: dict[str, dict[str, Any]] = {}
    for r in data["rows"]:
        if r.get("system") in HEADLINE_SYSTEMS and "tokens_per_s" in r and r.get("round", "median") == "median":
            rows.setdefault(r["system"], r)
    lines = ["| system | tokens/s | vs its DeepSpeed peer |", "|---|---|---|"]
    for system, (label, peer) in HEADLINE_SYSTEMS.items():
        tps = rows[system]["tokens_per_s"]
        lines.append(f"| {label} | {cell(tps)} | {tps / rows[peer]['tokens_per_s']:.2f}x {PEERS[peer]} |")
    plot = ([f"![{HEADLINE.file}](benchmarks/results/{HEADLINE.file}.png)", ""]
            if (RESULTS / f"{HEADLINE.file}.png").exists() else [])
    return "\n".join([
        *plot, *lines, "",
        f"{HEADLINE.caption}; `{data.get('command', '')}` on {machine(data)}, {committed(RESULTS / f'{HEADLINE.file}.json')}.",
    ])


def scale_rows(result: Result) -> list[tuple[str, dict[str, Any] | None, dict[str, Any] | None]]:
    """Per system of ``result``'s file: its label, the largest size it trained (or None) and the first
    larger size it did not (or None)."""
    data = load(result.file)
    budget = data["settings"].get("host_budget_gb")
    out = []
    for system in data["settings"]["systems"]:
        rows = [r for r in data["rows"] if r["system"] == system]
        best = max((r for r in rows if r["status"] == "trained"), key=lambda r: r["params"], default=None)
        failed = next((r for r in rows if r["status"] != "trained"
                       and (best is None or r["params"] > best["params"])), None)
        label = system if budget is None or system == "deepspeed" else f"{system}, host budget {cell(budget)} GiB"
        if data["settings"].get("label"):
            label = f"{label} ({data['settings']['label']})"
        out.append((label, best, failed))
    return out


def scale_table() -> str:
    """The README's size table, from :data:`SCALE`'s files only: per system, the largest size it trained and
    the first it did not, with why (the status's first word: the Benchmarks page has the whole of it)."""
    lines = ["| system | largest trained | parameters | peak RSS | time to first step | step | next size |",
             "|---|---|---|---|---|---|---|"]
    notes = []
    for result in SCALE:
        data = load(result.file)
        m = data["machine"]
        for label, best, failed in scale_rows(result):
            why = f"{failed['size']}: {failed['status'].split(':')[0]}" if failed is not None else "-"
            if best is None:
                lines.append(f"| {label} | none | - | - | - | - | {why} |")
                continue
            lines.append(f"| {label} | {best['size']} | {best['params'] / 1e9:.2f}B | {cell(best['peak_rss_gb'])} GiB "
                         f"({best['peak_rss_gb'] / m['mem_total_gb']:.0%} of RAM) | {cell(best['time_to_first_step_s'])} s | "
                         f"{cell(best['step_s'])} s | {why} |")
        notes += [f"{result.caption}: `{data.get('command', '')}`, {committed(RESULTS / f'{result.file}.json')}.", ""]
    m = load(SCALE[0].file)["machine"]
    return "\n".join([
        *lines, "",
        f"On {machine(load(SCALE[0].file))}, {cell(m['mem_total_gb'])} GiB RAM, {cell(m['disk_free_gb'])} GB free "
        "disk (`status` on the Benchmarks page says why a size did not run).", "", *notes[:-1],
    ])


RAM = (Result("memory_defaults_fp32_steps_after_backward", "Peak RSS, 32-true"),
       Result("memory_defaults_bf16_steps_after_backward", "Peak RSS, bf16-mixed"),
       Result("compare_steady_seq128_fp32_after_backward", "Step time, 32-true (steps 3 to 6)"))
"""The README's table of the defaults with every kind in RAM against Lightning in memory: peak RSS
(``benchmarks/memory.py``) and step time (``benchmarks/compare.py``), each round and the medians."""

RAM_PAIRS = (("lightning_auto", "greedysnake_defaults"), ("lightning_auto_bf16", "greedysnake_defaults_bf16"),
             ("lightning_auto", "gs_default"))
"""(Lightning, the defaults) as memory.py's ``config`` and compare.py's ``system`` name them."""


def ram_rows(result: Result) -> tuple[str, list[float], float]:
    """``result``'s value for the defaults and for Lightning (peak RSS in MB, or seconds a step), as
    (both medians in words, each round's ratio of the defaults to Lightning, the ratio of the medians)."""
    data = load(result.file)
    by_round: dict[Any, dict[str, float]] = {}
    for r in data["rows"]:
        name = r.get("config", r.get("system"))
        by_round.setdefault(r.get("round", "median"), {})[name] = r["peak_rss_mb"] if "peak_rss_mb" in r else r["step_s"]
    lightning, ours = next((a, b) for a, b in RAM_PAIRS if b in by_round["median"])
    rounds = [v[ours] / v[lightning] for k, v in sorted(by_round.items(), key=str) if k != "median"]
    median = by_round["median"]
    unit = "MB" if "peak_rss_mb" in data["rows"][0] else "s"
    words = f"{median[ours]:,.{0 if unit == 'MB' else 3}f} {unit} against {median[lightning]:,.{0 if unit == 'MB' else 3}f} {unit}"
    return words, rounds, median[ours] / median[lightning]


def ram_table() -> str:
    """The README's table of :data:`RAM`'s files only: the defaults against Lightning in memory."""
    lines = [("| the defaults (every kind in RAM) against Lightning in memory | medians | the defaults / Lightning, "
              "each round | of the medians |"),
             "|---|---|---|---|"]
    for result in RAM:
        words, rounds, ratio = ram_rows(result)
        lines.append(f"| {result.caption} | {words} | {', '.join(f'{r:.3f}x' for r in rounds)} | {ratio:.3f}x |")
    notes = [f"`{load(r.file).get('command', '')}` ({r.file}.json)" for r in RAM]
    return "\n".join([*lines, "", f"GPT 1024 x 12 (168M), sequence 128, K=8, on {machine(load(RAM[0].file))}: "
                      + "; ".join(notes) + "."])


README_BLOCKS = {"headline": headline, "ram": ram_table, "scale": scale_table}
"""The README's generated blocks, each between ``<!-- gen:NAME (benchmarks/report.py --readme) -->`` and
``<!-- /gen:NAME -->``."""


def readme_generated(text: str) -> str:
    """``text`` (the README) with each of its generated blocks regenerated."""
    for name, render_block in README_BLOCKS.items():
        start, end = f"<!-- gen:{name} (benchmarks/report.py --readme) -->", f"<!-- /gen:{name} -->"
        a, b = text.index(start) + len(start), text.index(end)
        text = text[:a] + "\n" + render_block() + "\n" + text[b:]
    return text


ON_OTHER_PAGES = {"optimizer_audit": "docs/reference/status.md"}
"""Result files rendered on another page of the docs (by ``docs/hooks/reference.py``), not this one."""


def unlisted() -> list[str]:
    """Result files that are neither on a page nor archived."""
    listed = set(current_files()) | {p.stem for p in gpu_files()} | set(ON_OTHER_PAGES)
    return sorted(p.stem for p in RESULTS.glob("*.json") if p.stem not in listed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="fail when a results file is neither on the page nor in results/archive/")
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's generated blocks and stop")
    args = parser.parse_args(argv)
    if args.readme:
        readme = RESULTS.parent.parent / "README.md"
        readme.write_text(readme_generated(readme.read_text()))
        return
    print(render())
    if args.check and unlisted():
        sys.exit(f"not on the benchmark page and not archived: {unlisted()}. Fix: add it to SECTIONS in "
                 "benchmarks/report.py, or `git mv` it into benchmarks/results/archive/.")


if __name__ == "__main__":
    main()
