"""The application: what assembles the algorithm core (`rollverify`) and the two wings (`sglang_ext`,
`megatron_bridge`) into runs. The run config composing the sections (`config`), the command line (`cli`),
`train` / `demo` / `evaluate` / `export` / `plan`, the Ray placement (`cluster`, `ray_placement`), the weight
transport between the wings (`weight_transport`), run folders, console output and the tiny CPU model.

It may import anything; nothing outside it imports it (tests/test_layers.py holds every import to that).
"""
