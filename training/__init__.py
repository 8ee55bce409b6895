"""Training stages: collect, train_agent, train_autoencoder, train_diffusion, evaluate, export."""

import neuraldoom  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
