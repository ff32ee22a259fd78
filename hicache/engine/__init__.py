"""The MLA decode engine: tiny model, latent attention with LSE, DCP merge backends, runner."""
