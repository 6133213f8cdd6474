/* libucp's calls, resolved at run time (dlopen, dlsym) from the library Python chose.
 * A part of the UCX transport (core/transport/bps_ucx.h), which includes it when BPS_HAVE_UCX is set.
 */
#ifndef BPS_UCX_API_H
#define BPS_UCX_API_H

#include <string>
#include <vector>

#include "core/transport/bps_link.h"
#include "core/transport/bps_wire.h"

/* what every part of the UCX transport uses */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>

#include <ucp/api/ucp.h>

/* libucp's calls, resolved at run time from the library Python chose. */
struct BpsUcxApi {
#define BPS_UCX_FN(name) decltype(&::name) name = nullptr
    BPS_UCX_FN(ucp_config_read);
    BPS_UCX_FN(ucp_config_release);
    BPS_UCX_FN(ucp_init_version);
    BPS_UCX_FN(ucp_cleanup);
    BPS_UCX_FN(ucp_get_version_string);
    BPS_UCX_FN(ucp_worker_create);
    BPS_UCX_FN(ucp_worker_destroy);
    BPS_UCX_FN(ucp_worker_progress);
    BPS_UCX_FN(ucp_worker_get_efd);
    BPS_UCX_FN(ucp_worker_arm);
    BPS_UCX_FN(ucp_worker_set_am_recv_handler);
    BPS_UCX_FN(ucp_listener_create);
    BPS_UCX_FN(ucp_listener_destroy);
    BPS_UCX_FN(ucp_listener_query);
    BPS_UCX_FN(ucp_ep_create);
    BPS_UCX_FN(ucp_ep_close_nbx);
    BPS_UCX_FN(ucp_ep_query);
    BPS_UCX_FN(ucp_am_send_nbx);
    BPS_UCX_FN(ucp_am_recv_data_nbx);
    BPS_UCX_FN(ucp_request_check_status);
    BPS_UCX_FN(ucp_request_free);
    BPS_UCX_FN(ucs_status_string);
    BPS_UCX_FN(ucp_mem_map);
    BPS_UCX_FN(ucp_mem_unmap);
    BPS_UCX_FN(ucp_worker_query);
    BPS_UCX_FN(ucp_get_version);
#undef BPS_UCX_FN
    bool loaded = false;
    bool memh_param = false; /* ucp_request_param_t.memh is honoured: UCX 1.14 or later */
    std::string why = "UCX was not loaded (byteps.core.ucx.load())";
};
static BpsUcxApi bps_ucx;

/* Resolve libucp's calls from ``path`` (already loaded by Python, or loadable); 0, or -1 (bps_ucx.why). */
static inline int bps_ucx_load(const char *path) {
    if (bps_ucx.loaded) return 0;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
        const char *e = dlerror();
        bps_ucx.why = std::string("cannot load ") + path + ": " + (e ? e : "?");
        return -1;
    }
#define BPS_UCX_SYM(name)                                                      \
    bps_ucx.name = (decltype(bps_ucx.name))dlsym(h, #name);                    \
    if (bps_ucx.name == nullptr) {                                             \
        bps_ucx.why = std::string(path) + " lacks " #name " (UCX too old?)";   \
        return -1;                                                             \
    }
    BPS_UCX_SYM(ucp_config_read)
    BPS_UCX_SYM(ucp_config_release)
    BPS_UCX_SYM(ucp_init_version)
    BPS_UCX_SYM(ucp_cleanup)
    BPS_UCX_SYM(ucp_get_version_string)
    BPS_UCX_SYM(ucp_worker_create)
    BPS_UCX_SYM(ucp_worker_destroy)
    BPS_UCX_SYM(ucp_worker_progress)
    BPS_UCX_SYM(ucp_worker_get_efd)
    BPS_UCX_SYM(ucp_worker_arm)
    BPS_UCX_SYM(ucp_worker_set_am_recv_handler)
    BPS_UCX_SYM(ucp_listener_create)
    BPS_UCX_SYM(ucp_listener_destroy)
    BPS_UCX_SYM(ucp_listener_query)
    BPS_UCX_SYM(ucp_ep_create)
    BPS_UCX_SYM(ucp_ep_close_nbx)
    BPS_UCX_SYM(ucp_ep_query)
    BPS_UCX_SYM(ucp_am_send_nbx)
    BPS_UCX_SYM(ucp_am_recv_data_nbx)
    BPS_UCX_SYM(ucp_request_check_status)
    BPS_UCX_SYM(ucp_request_free)
    BPS_UCX_SYM(ucs_status_string) /* libucs: dlsym searches libucp's dependencies too */
    BPS_UCX_SYM(ucp_mem_map)
    BPS_UCX_SYM(ucp_mem_unmap)
    BPS_UCX_SYM(ucp_worker_query)
    BPS_UCX_SYM(ucp_get_version)
#undef BPS_UCX_SYM
    unsigned major = 0, minor = 0, release = 0;
    bps_ucx.ucp_get_version(&major, &minor, &release);
    bps_ucx.memh_param = major > 1 || (major == 1 && minor >= 14);
    bps_ucx.loaded = true;
    bps_ucx.why.clear();
    return 0;
}

static inline std::string bps_ucx_error(ucs_status_t s) { return bps_ucx.ucs_status_string(s); }

/* What the log says about UCX: its version. */
static inline std::string bps_ucx_version() { return bps_ucx.loaded ? bps_ucx.ucp_get_version_string() : ""; }

#endif /* BPS_UCX_API_H */
