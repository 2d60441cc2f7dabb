"""Model surgery: ``apply_recipe`` swaps the quantized ``dot_general`` into a model's Linears.

Which Linears get which recipe (FiLj per layer, stacked layers, the LM head's FP32 weight
gradient) is decided here; the model code never mentions precision.
"""
