"""Names in sysfs trees that are not the kernel's: what the fake sysfs writer tells the agent about its tree."""

#: A file at the root of a fake sysfs tree whose writer changes files only the way sysfs does: an attribute's
#: new text is written over the old one in place (same inode: a descriptor kept open reads it), never by a
#: rename; files and directories are made when their device is and go only with it (a device that goes or
#: comes back is a whole directory removed or made anew). The agent then reads the tree as it reads sysfs,
#: without the checks a tree of files replaced by rename needs (``collectors/sysfsfiles.py``).
IN_PLACE_MARKER = ".gpufleet-sysfs-in-place"
