# SPDX-License-Identifier: Apache-2.0
"""The fork's identity: upstream release and fork revision, read from the installed version."""

import re


def fork_version_parts(version=None):
    """('0.19.8', 1) for '0.19.8+hetero.1'; (version, None) for a build without the fork's label."""
    if version is None:
        from deepspeed.git_version_info import version
    match = re.match(r"^([^+]+)\+(?:.*\.)?hetero\.(\d+)", version)
    if not match:
        return version, None
    return match.group(1), int(match.group(2))


def fork_summary(version=None):
    upstream, revision = fork_version_parts(version)
    if revision is None:
        return f"not installed through setup.py (version {upstream}); run 'pip install -e .' in the tree"
    return f"fork revision {revision} on upstream DeepSpeed {upstream}"
