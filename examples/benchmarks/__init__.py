"""The side-by-side benchmark (`examples/benchmark.py`) and the measuring tools beside it.

side_by_side.py      the benchmark: rounds of runs, each timed; --cpu-overhead; the entry point
bench_args.py        its command line and the model configuration the flags make
bench_build.py       the contenders: one model parallelised each way (ours, FSDP2, DDP, floors)
bench_mesh.py        --mesh: the device mesh of the sharded contenders, the tokens per GPU
bench_optim.py       --optimizer: fused AdamW, or Muon beside AdamW
bench_float8.py      --float8: torchao float8 training for every contender
bench_deepspeed.py   --runs deepspeed_offload: DeepSpeed ZeRO-3 with ZeRO-Offload, the contender's engine and step
bench_overhead.py    --cpu-overhead: the CPU cost of the hooks per step
bench_report.py      the table, the ours/theirs ratios, the JSON file, the Chrome trace
bench_links.py       each group of a 2D mesh timed alone (examples/bench_links.py)
bench_muon_floor.py  Muon's Newton-Schulz floor on one GPU (examples/bench_muon_floor.py)
bench_muon_step.py   the optimizer step alone, Muon against AdamW (examples/bench_muon_step.py)
bench_host_step.py   an offloaded, clipped step's host operations, each timed (examples/bench_host_step.py)
bench_qlora.py       QLoRA throughput and memory, ours against FSDP2 (examples/bench_qlora.py)
bench_ft_recovery.py a torchft replica group lost and restarted, timed (examples/bench_ft_recovery.py)
trace_overlap.py     where the GPU's time goes in a benchmark trace (examples/trace_overlap.py)
trace_nccl.py        every rank's NCCL kernels of one run, lined up (examples/trace_nccl.py)
"""
