"""In-process recovery: a training function run again in the same processes after a
peer fails, with no single host. :mod:`.nvrx` gives NVIDIA's in-process ``Wrapper``
its stores on etcd (it imports torch and NVRx; nothing here imports them)."""
