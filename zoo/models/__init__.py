"""One self-contained file per model family; importing them registers them."""
import importlib

FAMILIES = ("transformer", "bert", "effnetv2", "diffusion_unet", "unet3d")

for _family in FAMILIES:
    importlib.import_module(f"zoo.models.{_family}")
