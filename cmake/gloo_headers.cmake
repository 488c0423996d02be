# gloo's headers for c10d's ProcessGroupGloo.hpp (src/distributed.cpp only).
#
# torch wheels link gloo into libtorch_cpu but ship none of its headers.
# ProcessGroupGloo.hpp needs gloo's declarations only for types it holds by
# pointer (shared_ptr<gloo::Context>, shared_ptr<gloo::transport::Device>,
# unique_ptr<gloo::transport::UnboundBuffer>) and for GlooStore, whose vtable
# is emitted in libtorch: no gloo class layout is compiled into nanguard, so
# an older gloo (Debian 12's libgloo-dev, git 2022-05-18) serves the newer one
# torch was built with. Set NANGUARD_GLOO_INCLUDE_DIR to use other headers
# (a copy carried to a machine without Debian's packages).
find_path(NANGUARD_GLOO_INCLUDE_DIR gloo/rendezvous/store.h
  DOC "Folder holding gloo/rendezvous/store.h (Debian: libgloo-dev)")
if(NOT NANGUARD_GLOO_INCLUDE_DIR)
  message(FATAL_ERROR "nanguard: gloo's headers were not found (needed by c10d's ProcessGroupGloo.hpp). "
    "Install them (Debian: apt-get install libgloo-dev, which scripts/setup-deps does) "
    "or pass -DNANGUARD_GLOO_INCLUDE_DIR=<folder holding gloo/rendezvous/store.h>.")
endif()
