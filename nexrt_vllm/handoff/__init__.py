"""What both ends of a hand-off share: the typed HTTP / claim bodies (``contracts``) and the control
protocol (``protocol``), both defined as wire bodies (``wire``), the layout descriptor and its
validation (``layout``), the heads a tensor-parallel part holds (``sharding``), the sender
(``sender``) and the transfer engines (``transport``).

Pure Python (no torch, no vLLM): the router imports it.
"""
