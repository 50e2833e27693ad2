"""Where a journal may live: local disks only.

SQLite's WAL mode needs shared memory between the processes that open a database, which network
filesystems cannot provide; its locking is unreliable there too. Cloud-sync folders copy the file
behind SQLite's back. Both silently lose the guarantees the journal exists for, so we refuse them.
This module imports nothing from Airflow.
"""

from __future__ import annotations

import os
from pathlib import Path

MOUNTINFO = "/proc/self/mountinfo"

# Kernel filesystem types that are network or cluster filesystems.
NETWORK_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb",
        "smb2",
        "smb3",
        "smbfs",
        "ncpfs",
        "afs",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ocfs2",
        "gfs2",
        "9p",  # WSL's Windows drives and VM shares
        "davfs",
        "coda",
        "orangefs",
    }
)

# FUSE subtypes (mountinfo shows "fuse.<name>") that talk to a network or a cloud service.
NETWORK_FUSE_SUBTYPES = frozenset(
    {
        "sshfs",
        "rclone",
        "s3fs",
        "gcsfuse",
        "goofys",
        "davfs2",
        "glusterfs",
        "google-drive-ocamlfuse",
        "onedriver",
        "dropbox",
        "mountpoint-s3",
        "blobfuse",
        "blobfuse2",
        "juicefs",
        "cephfs",
        "ceph-fuse",
        "seaweedfs",
        "moosefs",
        "lizardfs",
        "gvfsd-fuse",
        "ipfs",
        "keybase",
    }
)

# Folder names that sync clients (Dropbox, OneDrive, Google Drive, iCloud, ...) own on a local disk.
CLOUD_SYNC_FOLDERS = ("dropbox", "onedrive", "google drive", "googledrive", "icloud drive", "mobile documents")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    return (
        field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
    )


def filesystem_type(path: Path, mountinfo: str = MOUNTINFO) -> str | None:
    """Filesystem type of the mount holding ``path`` (the longest matching mount point)."""
    target = str(path)
    best_point, best_type = "", None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                left, sep, right = line.partition(" - ")
                if not sep:
                    continue
                fields, right_fields = left.split(), right.split()
                if len(fields) < 5 or not right_fields:
                    continue
                point = _unescape(fields[4])
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best_point):
                    best_point, best_type = point, right_fields[0]
    except OSError:
        return None  # no mount table (not Linux): nothing to detect from
    return best_type


def network_location_reason(path: Path, mountinfo: str = MOUNTINFO) -> str | None:
    """Why ``path`` is on a network or cloud-sync filesystem, or None if it looks local."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    resolved = Path(os.path.realpath(existing))
    fs_type = filesystem_type(resolved, mountinfo)
    if fs_type is not None:
        base, _, subtype = fs_type.partition(".")
        if base in NETWORK_FS_TYPES:
            return f"it is on a {fs_type} network filesystem"
        if base in ("fuse", "fuseblk") and subtype in NETWORK_FUSE_SUBTYPES:
            return f"it is on a {fs_type} network filesystem"
    lowered = [part.lower() for part in Path(os.path.realpath(path)).parts]
    for part in lowered:
        if any(part == name or part.startswith(name + " ") or part.startswith(name + "-")
               for name in CLOUD_SYNC_FOLDERS):
            return f"it is inside a cloud-sync folder ({part!r})"
    return None
