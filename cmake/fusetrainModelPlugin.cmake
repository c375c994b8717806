# fusetrain_add_model_plugin(<target> <sources>...): a model plugin for
# `fusetrain train` (model.library), a shared library whose sources register
# their models with FUSETRAIN_REGISTER_MODEL (<fusetrain/trainer/model.h>).
#
#   find_package(fusetrain REQUIRED)
#   fusetrain_add_model_plugin(my_model my_model.cpp)   # -> libmy_model.so
#
# It links fusetrain and the torch it was built against, with the flags the
# trainer's own code uses (C++ standard, position-independent code), and
# leaves its symbols unresolved against libfusetrain and libtorch, which the
# trainer has loaded when it opens the plugin.
function(fusetrain_add_model_plugin target)
  if(ARGC LESS 2)
    message(FATAL_ERROR "fusetrain_add_model_plugin(${target}): give the plugin's source files")
  endif()
  add_library(${target} MODULE ${ARGN})
  target_link_libraries(${target} PRIVATE fusetrain::fusetrain)
  get_target_property(_fusetrain_features fusetrain::fusetrain INTERFACE_COMPILE_FEATURES)
  set_target_properties(${target} PROPERTIES
    POSITION_INDEPENDENT_CODE ON
    PREFIX "lib")
  if(NOT _fusetrain_features)
    target_compile_features(${target} PRIVATE cxx_std_17)
  endif()
endfunction()
