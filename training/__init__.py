"""DFlash drafter training: target-generated data, block-diffusion objective, published checkpoint layout.

    python -m training --config training/configs/smollm2_135m.json            # all stages, resumable
    torchrun --nproc-per-node 8 -m training --config <config>                 # data parallel
"""
