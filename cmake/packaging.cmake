# `cpack -G DEB` in a build folder: accel_<version>_amd64.deb for Debian 12 (docs/install.md).
# Files go under /usr (binaries, libaccel, headers, the CMake package, the unit in
# /usr/lib/systemd/system), /etc/accel/agent.yaml is a conffile, and postinst creates the
# `accel` system user without enabling or starting the agent.
set(CPACK_PACKAGE_NAME accel)
set(CPACK_PACKAGE_VENDOR accel)
set(CPACK_PACKAGE_CONTACT "accel maintainers <accel@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "launcher, node agent and training runtime for libtorch and PyTorch jobs")
set(CPACK_PACKAGE_DESCRIPTION
    "accel-launch starts and supervises the worker processes of a training job (torchrun's\
 environment, restarts, hang detection, no orphans); accel-agent runs them on standing nodes\
 under systemd or Slurm; libaccel is an HF Accelerate-style runtime for libtorch programs.")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_GENERATOR DEB)
# Why DESTDIR: the install rules write the unit's ExecStart from CMAKE_INSTALL_PREFIX, which must
# be /usr (where the package puts accel-agent), not the staging folder.
set(CPACK_SET_DESTDIR ON)
set(CPACK_INSTALL_PREFIX /usr)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # accel_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_SECTION devel)
# Runtime dependencies from the binaries' shared libraries (dpkg-shlibdeps: libtorch1.13,
# libgrpc++1.51, libprotobuf32, libyaml-cpp0.7, ...), plus what the scripts and the unit use.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "adduser, libopenblas0-pthread")
# Building a program of your own against libaccel needs libtorch's headers and CMake files.
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "libtorch-dev, cmake, g++, python3")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "python3-torch, slurm-client")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    ${PROJECT_SOURCE_DIR}/packaging/deb/postinst ${PROJECT_SOURCE_DIR}/packaging/deb/prerm
    ${PROJECT_SOURCE_DIR}/packaging/deb/postrm ${PROJECT_SOURCE_DIR}/packaging/deb/conffiles)
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
# gzip: xz takes minutes on 2 cores for libaccel's size, for a package a third smaller.
set(CPACK_DEBIAN_COMPRESSION_TYPE gzip)
include(CPack)
