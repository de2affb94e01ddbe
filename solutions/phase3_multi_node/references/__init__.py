"""What exercises are checked against besides PyTorch: one process running every expert on every
token, and the ZeRO paper's formulas beside the bytes measured.

* ``moe``: One process running every expert on every token: what exercise 3.8 must equal.
* ``zero_accounting``: The ZeRO paper's memory and communication formulas, and the same
  quantities measured.
"""
