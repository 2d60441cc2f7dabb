"""A run folder's files: checkpoints, the one reader of a saved run, weight initialization
from another run or a Hugging Face folder, and export to Hugging Face."""
