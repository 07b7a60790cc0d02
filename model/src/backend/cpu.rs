//! CPU backend over `arbor_kernels::cpu` and a host `Communicator`. (Model work fills it.)
