# Note [Linking against pip's torch]: a CUDA torch from PyPI finds NCCL, cuDNN
# and the CUDA libraries it needs in the nvidia-* wheels beside it
# (site-packages/nvidia/*/lib, through its $ORIGIN RPATH), but the linker does
# not follow that RPATH when it checks an executable's indirect dependencies:
# it takes the first libnccl.so.2 of ld.so.conf, the CUDA toolkit's, and
# torch 2.15's libtorch_cuda.so needs NCCL symbols newer than toolkit 13.0's
# (ncclCommGrow, ncclWaitSignal, ...). The wheels' folders go first in the
# linker's -rpath-link: only the link-time search changes, not what the
# programs load at run time. Used by fusetrain's own build and by the
# installed fusetrainConfig.cmake, since every LibTorch program linked against
# pip's torch meets the same problem.

# The -rpath-link option for the torch found by find_package(Torch), in
# OUT_VAR; empty when that torch has no nvidia wheels beside it.
function(fusetrain_torch_rpath_link out_var)
  set(_dirs "")
  if(TORCH_INSTALL_PREFIX)
    file(GLOB _dirs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
  endif()
  if(_dirs)
    list(JOIN _dirs ":" _joined)
    set(${out_var} "-Wl,-rpath-link,${_joined}" PARENT_SCOPE)
  else()
    set(${out_var} "" PARENT_SCOPE)
  endif()
endfunction()
