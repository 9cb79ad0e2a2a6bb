"""The scale estimator (`python examples/estimate.py`): memory, communication and time on paper.

estimate_cli.py       the command line and the report; the entry point
estimate_setup.py     what is estimated: the model shape and the training setup, validated
estimate_memory.py    per-rank peak memory, from an analytic model of the engine
estimate_comm.py      one step's communication, counted on the real engine on fake tensors
estimate_time.py      communication time, and whether it hides behind compute
estimate_pipeline.py  --pp N: one pipeline stage on paper
estimate_plot.py      --plot: memory and bytes sent against world size, per layout
estimate_bench.py     --benchmark: the estimate beside a benchmark's measurement
"""
