"""Developer tools that sit above the engine: they may import any layer of ferry
(engine, models, kernels), and nothing in the engine imports them.

    python -m ferry.tools.compile_check   compile the engine's Triton kernels for a GPU without one
"""
