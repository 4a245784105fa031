# SPDX-License-Identifier: Apache-2.0
"""Debug switch for vToken's deep checks (`VTOKEN_CHECK_INTEGRITY=1`).

Boundaries (engine arguments, policy knobs, a policy's answer) always raise clear
errors. Calls between overlay modules only `assert` their cheap preconditions;
the costly ones (uniqueness, ranges over whole arrays) and the scheduler's
`check_integrity()` after every step run only when this is on. Read at call
time (`integrity.CHECK`), so tests can turn it on without an environment
variable.
"""

import os

CHECK = os.environ.get("VTOKEN_CHECK_INTEGRITY", "0") == "1"
