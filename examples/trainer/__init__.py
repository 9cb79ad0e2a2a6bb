"""The main job (`python examples/train.py`) and QLoRA fine-tuning (`examples/qlora.py`).

main_job.py        the entry point: spawn or join the ranks, settle the run, the device and the meshes
training_loop.py   build the model and optimizer, resume, the steps (evaluate, checkpoint), the summary
options.py         the command line parsed: per-preset defaults, the checks that refuse bad values
flags.py           the flags, in groups, and the parser that reports a bad value in one line
launch.py          starting and ending the ranks: spawn or torchrun, bounded teardown, exit codes
watchdog.py        heartbeats and the stall watchdog of the ranks
runs.py            run directories: each run owns <out>/<run id>/, identity checks for --resume
checkpointing.py   atomic, checksummed DCP checkpoints: save, verify, load the newest intact one
data.py            byte-level data from the Python standard library's source, with a held-out split
parallel.py        the device mesh and the layout: compile, activation checkpointing, TP, sharding
pipeline.py        pipeline parallelism (--pp): the pp mesh, this rank's stages, the schedule
train_step.py      one training step as a function of its batch, and running it as a CUDA graph
schedule.py        the optimizer, the learning-rate schedule, the held-out evaluation
muon_adamw.py      Muon on the hidden matrices and AdamW on the rest, as one optimizer
memory_check.py    a low estimate of a rank's memory, refused up front when it cannot fit
reporting.py       metrics.json / metrics.csv, loss.png, the progress bar and the summary
fault_tolerance.py --fault-tolerant: this launch as one torchft replica group
qlora.py           QLoRA: NF4 base weights with LoRA adapters on an HF Llama, sharded and trained
"""
