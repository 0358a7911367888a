"""The exllamav3 backend (imported only when ``--engine exl3`` is chosen: it needs CUDA and exllamav3)."""
