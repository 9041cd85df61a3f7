"""Credentials in what an export writes: found by name (``OPENAI_API_KEY``, ``api_key``, ``token``,
``password``, the variable an ``os.getenv`` default stands in for) or by form (``sk-...``, ``hf_...``,
``ghp_...``, ``AKIA...``, ``Bearer ...``, a URL with a password), and replaced in the script by a read
of an environment variable, redacted in a comment, or left out of a data file. Obvious placeholders
(``api_key="EMPTY"``, ``"ollama"``, ``"sk-no-key-required"``) are kept as written.

Modules: ``recognition`` says what a credential looks like (``secret_in``); ``code_scrubbing``
finds and replaces them in Python source; ``secrets`` holds ``Secrets``, what one export found and
what the script does instead.
"""

from grpo_lab.credentials.recognition import SECRET_ENV_NAMES, secret_in
from grpo_lab.credentials.secrets import Secrets

__all__ = ["SECRET_ENV_NAMES", "Secrets", "secret_in"]
