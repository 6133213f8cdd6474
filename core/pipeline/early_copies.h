/* The local reduce's copies that came before their op: the LOCAL_READYs ([identity, header, body]) an
 * owner got for a partition (wire key, round) it has not started yet, held until it starts.
 *
 * Threads: byteps-net holds them (on_local) and takes them when the partition's LOCAL_REDUCE starts; a
 * direct owner (BpsWorkerCore::submit_owner_direct) takes its partition's on its own thread. One mutex
 * guards the map.
 */
#ifndef BPS_EARLY_COPIES_H
#define BPS_EARLY_COPIES_H

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/transport/bps_wire.h"

class BpsEarlyCopies {
  public:
    typedef std::pair<uint64_t, uint64_t> Ident;           /* (wire key, round) */
    typedef std::vector<std::vector<std::string>> Copies; /* [identity, header, body] each */

    void hold(const Ident &id, std::vector<std::string> frames) {
        std::lock_guard<std::mutex> lock(mu_);
        copies_[id].push_back(std::move(frames));
    }

    /* The copies of partition ``id`` (none: empty), which are no longer held. */
    Copies take(const Ident &id) {
        std::lock_guard<std::mutex> lock(mu_);
        auto e = copies_.find(id);
        if (e == copies_.end()) return Copies();
        Copies out = std::move(e->second);
        copies_.erase(e);
        return out;
    }

    /* The header of each held partition's first copy (join(): each is asked of Python). */
    std::vector<BpsHeader> first_headers() {
        std::vector<BpsHeader> out;
        std::lock_guard<std::mutex> lock(mu_);
        for (auto &kv : copies_) {
            if (kv.second.empty()) continue;
            BpsHeader h;
            memcpy(&h, kv.second[0][1].data(), sizeof h);
            out.push_back(h);
        }
        return out;
    }

    /* The engine failed: nothing held is for an op that will start. */
    void clear() {
        std::lock_guard<std::mutex> lock(mu_);
        copies_.clear();
    }

  private:
    std::mutex mu_;
    std::map<Ident, Copies> copies_;
};

#endif
