// emu_main.cpp: runs the cula-sm89 kernels' source under the host emulation of emu_cuda.h on inputs written by
// run_emu.py (raw float32 files in a folder), and writes o, the final state, w, u, Aqk and Akk back.
#define CULA_SM89_EMULATE 1
#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include "../csrc/kda_intra.cu"
#include "../csrc/kda_inter.cu"

using namespace cula_sm89;

static std::vector<float> read(const std::string& path, size_t n) {
    std::vector<float> v(n);
    std::ifstream f(path, std::ios::binary);
    if (!f) { std::fprintf(stderr, "cannot read %s\n", path.c_str()); std::exit(2); }
    f.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * 4));
    return v;
}
static void write(const std::string& path, const float* p, size_t n) {
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(p), std::streamsize(n * 4));
}

template <int K, int C>
static void run(const std::string& dir, std::map<std::string, double>& cfg) {
    const int64_t B = int64_t(cfg["B"]), T = int64_t(cfg["T"]), HQK = int64_t(cfg["HQK"]), HV = int64_t(cfg["HV"]);
    const bool varlen = cfg["varlen"] != 0, has_h0 = cfg["h0"] != 0;
    const int64_t N = varlen ? int64_t(cfg["N"]) : B, V = K;
    std::vector<float> q = read(dir + "/q.bin", B * T * HQK * K), k = read(dir + "/k.bin", B * T * HQK * K);
    std::vector<float> v = read(dir + "/v.bin", B * T * HV * V), g = read(dir + "/g.bin", B * T * HV * K);
    std::vector<float> beta = read(dir + "/beta.bin", B * T * HV);
    std::vector<float> h0 = has_h0 ? read(dir + "/h0.bin", N * HV * K * V) : std::vector<float>();
    std::vector<int32_t> cu;
    if (varlen) {
        std::vector<float> cuf = read(dir + "/cu.bin", N + 1);
        for (float x : cuf) cu.push_back(int32_t(x));
    }
    const int64_t rows = varlen ? 1 : B, slots = (T + C - 1) / C + (varlen ? N : 0);
    const float nan = std::nanf("");
    std::vector<float> o(B * T * HV * V, nan), ht(N * HV * K * V, nan);
    const size_t per = size_t(rows * HV * slots);
    std::vector<float> w(per * C * K, nan), u(per * C * V, nan), qw(per * C * K, nan), ou(per * C * V, nan),
        kgT(per * K * C, nan), gl(per * K, nan), aqk(per * C * C, nan), akk(per * C * C, nan);
    std::vector<int32_t> offs(N + 1, -1);

    KdaParams p;
    std::memset(&p, 0, sizeof(p));
    p.q = q.data(); p.k = k.data(); p.v = v.data(); p.g = g.data(); p.beta = beta.data();
    p.q_sb = T * HQK * K; p.q_st = HQK * K; p.q_sh = K;
    p.k_sb = p.q_sb; p.k_st = p.q_st; p.k_sh = p.q_sh;
    p.v_sb = T * HV * V; p.v_st = HV * V; p.v_sh = V;
    p.g_sb = T * HV * K; p.g_st = HV * K; p.g_sh = K;
    p.b_sb = T * HV; p.b_st = HV; p.b_sh = 1;
    p.o_sb = p.v_sb; p.o_st = p.v_st; p.o_sh = p.v_sh;
    p.h0 = has_h0 ? h0.data() : nullptr;
    p.cu_seqlens = varlen ? cu.data() : nullptr;
    p.o = o.data(); p.ht = ht.data();
    p.w = w.data(); p.u = u.data(); p.qw = qw.data(); p.ou = ou.data(); p.kgT = kgT.data(); p.gl = gl.data();
    p.chunk_offsets = varlen ? offs.data() : nullptr;
    p.dbg_aqk = aqk.data(); p.dbg_akk = akk.data();
    p.T = T; p.HV = HV; p.N = N; p.rows = rows; p.slots = slots; p.group = int32_t(HV / HQK);
    p.scale = float(cfg["scale"]);

    if (varlen) emu::run_block(256, 0, 0, [&] { kda_chunk_offsets_kernel(p, C); });
    using Ti = IntraTiling<K, C>;
    for (int64_t b = 0; b < rows * HV * slots; ++b)
        emu::run_block(Ti::NT, unsigned(b), Ti::SMEM_BYTES, [&] { kda_intra_kernel<K, C>(p); });
    if (int(cfg["tile"]) == 16) {
        using Tn = InterTiling<K, C, 16, 4>;
        for (int64_t b = 0; b < N * HV * (V / 16); ++b)
            emu::run_block(Tn::NT, unsigned(b), Tn::SMEM_BYTES, [&] { kda_inter_kernel<K, C, 16, 4>(p); });
    } else {
        using Tn = InterTiling<K, C, 32, 8>;
        for (int64_t b = 0; b < N * HV * (V / 32); ++b)
            emu::run_block(Tn::NT, unsigned(b), Tn::SMEM_BYTES, [&] { kda_inter_kernel<K, C, 32, 8>(p); });
    }

    write(dir + "/o.out", o.data(), o.size());
    write(dir + "/ht.out", ht.data(), ht.size());
    write(dir + "/w.out", w.data(), w.size());
    write(dir + "/u.out", u.data(), u.size());
    write(dir + "/aqk.out", aqk.data(), aqk.size());
    write(dir + "/akk.out", akk.data(), akk.size());
    std::vector<float> offf(offs.begin(), offs.end());
    write(dir + "/offs.out", offf.data(), offf.size());
}

int main(int argc, char** argv) {
    if (argc != 2) { std::fprintf(stderr, "usage: emu_main DIR\n"); return 2; }
    const std::string dir = argv[1];
    std::map<std::string, double> cfg;
    std::ifstream f(dir + "/config.txt");
    std::string key;
    double val;
    while (f >> key >> val) cfg[key] = val;
    const int K = int(cfg["K"]), C = int(cfg["C"]);
    if (K == 64 && C == 32) run<64, 32>(dir, cfg);
    else if (K == 64 && C == 64) run<64, 64>(dir, cfg);
    else if (K == 128 && C == 32) run<128, 32>(dir, cfg);
    else if (K == 128 && C == 64) run<128, 64>(dir, cfg);
    else { std::fprintf(stderr, "unsupported K=%d C=%d\n", K, C); return 2; }
    return 0;
}
